"""The routed experts' kernel (kernels/moe.py, csrc/moe/experts.h: a layer's experts in one call)
against the arithmetic it promises, spelled out in float64 (quant.reference_linear: q8 activations
times the dequantized weights), for r8 layouts and the file's rows, gate/up apart (a GGUF file's
stacked experts) or fused, decode and prefill batches, one expert taking every token; and that
it never reads an expert no token chose."""
from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import moe as moe_kernels
from pagedserve.kernels import quant
from pagedserve.kernels.cpu_ops import CpuOps
from pagedserve.models.moe import (ExpertWeights, MoESpec, MoEWeights, clamped_swiglu, count_expert_reads, moe_forward,
                                   route)

H, I, E, K = 256, 64, 8, 2
KERNEL_VARIANTS = [v for v in ("avx512vnni", "vnni256", "avx2", "avxvnni", "scalar") if v in quant.supported_variants()]
GEMM_VARIANTS = [v for v in ("avx512vnni", "vnni256", "avx2") if v in quant.supported_variants()]     # with the r8 GEMM
R8_HERE = quant.EXPERT_R8_VARIANTS        # where repack(experts=True) makes the r8 layouts


def _mxfp4(w: torch.Tensor, g: torch.Generator) -> quant.QuantizedWeight:
    """Random MXFP4 blocks of w's shape (E8M0 scales 2^-7 .. 2^-4: weights up to about 0.4)."""
    rows, cols = w.shape
    blocks = torch.randint(0, 256, (rows, cols // 32, 17), dtype=torch.uint8, generator=g)
    blocks[..., 0] = torch.randint(120, 124, (rows, cols // 32), dtype=torch.uint8, generator=g)
    return quant.from_gguf_blocks("mxfp4", blocks.view(rows, -1), (rows, cols))


def _experts(qtype: str, fused: bool, r8: bool, seed: int = 0) -> list[ExpertWeights]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(E):
        gate, up, down = (torch.randn(r, c, generator=g) * 0.1 for r, c in ((I, H), (I, H), (H, I)))
        pack = (lambda w: quant.repack(w, experts=True)) if r8 else (lambda w: w)        # noqa: E731
        make = (lambda w: pack(_mxfp4(w, g))) if qtype == "mxfp4" else (lambda w: pack(quant.quantize(w, qtype)))  # noqa: E731
        gate_up = make(torch.cat([gate, up])) if fused else (make(gate), make(up))
        out.append(ExpertWeights(gate_up, make(down)))
    return out


def _parts(e: ExpertWeights):
    """(gate, up, down) in the file's layout (what reference_linear reads)."""
    gu = [quant.file_layout(p) for p in e.gate_up] if isinstance(e.gate_up, tuple) else \
        [quant.slice_rows(quant.file_layout(e.gate_up), 0, I), quant.slice_rows(quant.file_layout(e.gate_up), I, 2 * I)]
    return gu[0], gu[1], quant.file_layout(e.down)


def _reference(x: torch.Tensor, experts, weights: torch.Tensor, ids: torch.Tensor,
               spec: MoESpec | None = None) -> torch.Tensor:
    """The kernel's arithmetic in float64: per (token, expert) q8(x) . gate, q8(x) . up (plus their
    biases), SiLU-and-mul (or spec's clamped SwiGLU) in float32, q8 of that . down (plus its bias),
    weighted and summed."""
    out = torch.zeros(x.shape[0], H, dtype=torch.float64)
    for t in range(x.shape[0]):
        for s in range(ids.shape[1]):
            e = experts[int(ids[t, s])]
            gate, up, down = _parts(e)
            # the activations' blocks: those of the layouts the kernel runs (quant.SUPER_ACT: 256)
            first = e.gate_up[0] if isinstance(e.gate_up, tuple) else e.gate_up
            b1, b2 = (256 if m.qtype in quant.SUPER_ACT else 32 for m in (first, e.down))
            g, u = (quant.reference_linear(x[t:t + 1].float(), m, b1).float() for m in (gate, up))
            if e.gate_up_bias is not None:
                g, u = g + e.gate_up_bias[:I], u + e.gate_up_bias[I:]
            if spec is None or spec.activation == "silu":
                act = torch.nn.functional.silu(g) * u
            else:
                act = clamped_swiglu(torch.cat([g, u], dim=-1), spec.swiglu_alpha, spec.swiglu_limit)
            y = quant.reference_linear(act, down, b2)[0]
            out[t] += float(weights[t, s]) * (y if e.down_bias is None else y + e.down_bias.double())
    return out


def _route(x: torch.Tensor, one_expert: bool = False):
    g = torch.Generator().manual_seed(x.shape[0])
    logits = torch.randn(x.shape[0], E, generator=g)
    if one_expert:
        logits[:, 5] += 100.0
    return route(logits, MoESpec(E, K, I, norm_topk_prob=True))


@pytest.mark.parametrize("variant", KERNEL_VARIANTS)
@pytest.mark.parametrize("qtype,fused,r8", [("q4_0", False, True), ("q8_0", True, True), ("q4_0", True, False),
                                             ("q8_0", False, False)])
@pytest.mark.parametrize("tokens", [1, 6, 37])
def test_kernel_equals_its_arithmetic(variant, qtype, fused, r8, tokens):
    with quant.using_variant(variant):
        experts = _experts(qtype, fused, r8 and variant in R8_HERE)
        x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(1))
        weights, ids = _route(x, one_expert=tokens == 6)
        table = moe_kernels.expert_table(experts)
        if not r8 and variant in moe_kernels.R8_ONLY:        # the file's rows: not this build's kernel
            assert table is None
            return
        assert table is not None
        ours = moe_kernels.routed_experts(x, table, weights, ids)
        ref = _reference(x, experts, weights, ids)
    # the same integers; float32 sums in another order, and a q8 rounding of the SiLU output that
    # float32 and float64 may put on either side: far below the 8-bit activations' own error
    torch.testing.assert_close(ours.double(), ref, atol=2e-3 * ref.abs().max().item(), rtol=1e-3)


def test_bf16_rows_and_r8_equal_the_file_layout():
    """bf16 activations give the float32 ones' result where their values are the same; the r8
    layout and the file's rows give the same numbers."""
    if "avx2" not in quant.supported_variants():
        pytest.skip("r8 layouts are made on the 256-bit variants")
    with quant.using_variant("avx2"):
        x = torch.randn(9, H, generator=torch.Generator().manual_seed(2)).bfloat16()
        weights, ids = _route(x)
        plain, packed = (moe_kernels.expert_table(_experts("q4_0", False, r8)) for r8 in (False, True))
        a = moe_kernels.routed_experts(x, plain, weights, ids)
        b = moe_kernels.routed_experts(x, packed, weights, ids)
        c = moe_kernels.routed_experts(x.float(), packed, weights, ids)
    torch.testing.assert_close(a, b, atol=1e-4 * b.abs().max().item(), rtol=1e-5)
    assert torch.equal(b, c)


@pytest.mark.parametrize("variant", KERNEL_VARIANTS)
def test_a_row_is_the_same_alone_and_in_a_batch(variant):
    """Each output row's arithmetic does not depend on the other rows of the step (batch invariance)."""
    with quant.using_variant(variant):
        experts = _experts("q4_0", False, variant in R8_HERE)
        table = moe_kernels.expert_table(experts)
        x = torch.randn(7, H, generator=torch.Generator().manual_seed(3))
        weights, ids = _route(x)
        together = moe_kernels.routed_experts(x, table, weights, ids)
        for t in range(7):
            alone = moe_kernels.routed_experts(x[t:t + 1], table, weights[t:t + 1], ids[t:t + 1])
            assert torch.equal(alone[0], together[t])


def _pack(w: quant.QuantizedWeight) -> quant.QuantizedWeight:
    return quant.repack(w, experts=True)


def _k_quant_experts(pack) -> list[ExpertWeights]:
    """A Q4_K_M file's experts: gate and up q4_k, down q6_k (down's input a whole super-block)."""
    from tests.test_quant_kernels import weight
    width = 256
    return [ExpertWeights(tuple(pack(weight("q4_k", width, H, seed=3 * e + j)[0]) for j in (0, 1)),
                          pack(weight("q6_k", H, width, seed=3 * e + 2)[0])) for e in range(E)]


@pytest.mark.parametrize("variant", GEMM_VARIANTS)
@pytest.mark.parametrize("mix", ["q4_0", "q8_0", "q4_k_m"])
@pytest.mark.parametrize("tokens", [40, 70])
def test_gemm_groups_equal_the_dots(variant, mix, tokens):
    """Experts with kGemmMinRows pairs or more run the integer GEMM (r8 layouts, 256-bit builds); a
    token alone runs the dots: every row the same floats either way, with one expert taking every
    token (70: two of its tiles) or ~10 pairs an expert (batch invariance at prefill sizes)."""
    with quant.using_variant(variant):
        experts = _k_quant_experts(_pack) if mix == "q4_k_m" else _experts(mix, False, True)
        table = moe_kernels.expert_table(experts)
        x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(4)).bfloat16()
        weights, ids = _route(x, one_expert=tokens == 70)
        together = moe_kernels.routed_experts(x, table, weights, ids)
        for t in range(tokens):
            alone = moe_kernels.routed_experts(x[t:t + 1], table, weights[t:t + 1], ids[t:t + 1])
            assert torch.equal(alone[0], together[t]), t
        if mix == "q4_k_m":
            ref = _reference(x, experts, weights, ids)
            torch.testing.assert_close(together.double(), ref, atol=2e-3 * ref.abs().max().item(), rtol=1e-3)


@pytest.mark.parametrize("mix", ["q4_0", "q8_0", "q4_k_m", "mxfp4"])
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_the_avx512_build_gives_the_256_bit_builds_bits(mix, tokens):
    """The avx512vnni build runs the same r8 kernels (vpdpbusd's EVEX form where avx2 has maddubs +
    madd: the same integers) and GEMM: every output bit equal to the avx2 build's, decode and prefill."""
    if "avx512vnni" not in quant.supported_variants():
        pytest.skip("this CPU lacks the avx512vnni variant")
    experts = _k_quant_experts(_pack) if mix == "q4_k_m" else _experts(mix, True, True)
    x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(11))
    weights, ids = _route(x)
    table = moe_kernels.expert_table(experts)
    outs = []
    for variant in ("avx512vnni", "avx2"):
        with quant.using_variant(variant):
            outs.append(moe_kernels.routed_experts(x, table, weights, ids))
    assert outs[0] is not None and torch.equal(outs[0], outs[1])


def test_the_block_takes_the_kernel_and_reads_only_chosen_experts():
    """moe_forward with CpuOps runs quantized experts in the one call; every expert no token chose
    is NaN-poisoned and the output stays finite and equal; the counted reads are the chosen ones."""
    if quant.variant() not in KERNEL_VARIANTS:
        pytest.skip("the kernel does not run in this build")
    spec = MoESpec(E, K, I, norm_topk_prob=True)
    experts = _experts("q8_0", False, quant.variant() in R8_HERE)
    router = torch.randn(E, H, generator=torch.Generator().manual_seed(4)) * 0.3
    x = torch.randn(3, H, generator=torch.Generator().manual_seed(5))
    ops = CpuOps()
    calls = []
    original = ops.routed_experts
    ops.routed_experts = lambda *a: calls.append(1) or original(*a)
    before = moe_forward(x, MoEWeights(router, experts), spec, ops)
    assert calls
    _, ids = route(torch.nn.functional.linear(x, router), spec)
    chosen = set(ids.view(-1).tolist())
    assert len(chosen) < E
    for e, ex in enumerate(experts):
        if e not in chosen:
            for m in (*ex.gate_up, ex.down):
                m.data[:] = 0xFF          # every byte: fp16 scales of NaN, in either layout
    with count_expert_reads() as reads:
        after = moe_forward(x, MoEWeights(router, experts), spec, ops)
    assert reads.experts() == chosen
    assert torch.isfinite(after).all() and torch.equal(after, before)
    with pytest.raises(AssertionError):       # the poison shows where an expert is read
        assert torch.isfinite(moe_forward(x, MoEWeights(router, [experts[min(set(range(E)) - chosen)]] * E), spec,
                                          ops)).all()


def test_experts_the_kernel_does_not_take():
    """Float experts, a bias of the wrong size, one float matrix among quantized ones: no table
    (moe.py runs them one by one)."""
    floats = [ExpertWeights(torch.randn(2 * I, H), torch.randn(H, I)) for _ in range(E)]
    assert moe_kernels.expert_table(floats) is None
    biased = _experts("q8_0", True, False)
    biased[3].down_bias = torch.zeros(H + 1)
    assert moe_kernels.expert_table(biased) is None
    mixed = _experts("q8_0", True, False)
    mixed[5].down = quant.dequantize(mixed[5].down)
    assert moe_kernels.expert_table(mixed) is None


@pytest.mark.parametrize("variant", KERNEL_VARIANTS)
def test_k_quant_experts(variant):
    """A Q4_K_M file's experts (gate and up q4_k, down q6_k; r8 layouts on the 256-bit variants)
    against the same arithmetic in float64."""
    with quant.using_variant(variant):
        experts = _k_quant_experts(_pack if variant in R8_HERE else (lambda w: w))
        if variant in R8_HERE:
            assert experts[0].down.qtype == "q6_kr8" and experts[0].gate_up[0].qtype == "q4_kr8"
        x = torch.randn(5, H, generator=torch.Generator().manual_seed(6))
        weights, ids = _route(x)
        ours = moe_kernels.routed_experts(x, moe_kernels.expert_table(experts), weights, ids)
        ref = _reference(x, experts, weights, ids)
    torch.testing.assert_close(ours.double(), ref, atol=2e-3 * ref.abs().max().item(), rtol=1e-3)


def _gpt_oss_experts(qtype: str, fused: bool, r8: bool) -> list[ExpertWeights]:
    """_experts with gpt-oss's biases (gate_up [2 I], down [H]), large enough that the clamps bite."""
    g = torch.Generator().manual_seed(8)
    experts = _experts(qtype, fused, r8, seed=7)
    for e in experts:
        e.gate_up_bias = torch.randn(2 * I, generator=g) * 4
        e.down_bias = torch.randn(H, generator=g)
    return experts


@pytest.mark.parametrize("variant", KERNEL_VARIANTS)
@pytest.mark.parametrize("qtype,fused,r8", [("mxfp4", False, True), ("mxfp4", True, True), ("mxfp4", False, False),
                                           ("q8_0", False, True)])
@pytest.mark.parametrize("tokens", [1, 6])
def test_clamped_swiglu_with_biases(variant, qtype, fused, r8, tokens):
    """gpt-oss's experts: biases on gate, up and down, the clamped SwiGLU (alpha, limit) between;
    MXFP4 (its GGUF stacks gate and up apart; its HF checkpoint fused), in its r8 layout (mxfp4r8,
    made on the 256-bit variants) and its file's rows, and q8_0 in its r8 layout."""
    spec = MoESpec(E, K, I, scoring="topk_softmax", activation="clamped_swiglu", swiglu_alpha=1.702, swiglu_limit=7.0)
    with quant.using_variant(variant):
        r8 = r8 and variant in R8_HERE
        experts = _gpt_oss_experts(qtype, fused, r8)
        assert experts[0].down.qtype == (quant.R8_OF[qtype] if r8 else qtype)
        if not r8 and variant in moe_kernels.R8_ONLY:        # the file's rows: not this build's kernel
            assert moe_kernels.expert_table(experts) is None
            return
        x = torch.randn(tokens, H, generator=torch.Generator().manual_seed(9)) * 4
        weights, ids = _route(x, one_expert=tokens == 6)
        ours = moe_kernels.routed_experts(x, moe_kernels.expert_table(experts), weights, ids, moe_kernels.glu_of(spec))
        ref = _reference(x, experts, weights, ids, spec)
        plain = _reference(x, experts, weights, ids)            # SwiGLU over the same biased values
    torch.testing.assert_close(ours.double(), ref, atol=2e-3 * ref.abs().max().item(), rtol=1e-3)
    assert (plain - ref).abs().max() > 0.1 * ref.abs().max()     # the activation matters here
