"""The MoE block (models/moe.py) against transformers' own MoE block modules on random weights:
Qwen3-MoE, Mixtral, OLMoE, Qwen2-MoE (a shared expert) and gpt-oss (top-k then softmax, clamped
SwiGLU with biases), on batches of one token, of many, where some experts get no tokens and
where one expert gets every token; quantized experts computed in their blocks; and what the block
reads: only the chosen experts."""
from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import quant
from pagedserve.kernels.cpu_ops import CpuOps
from pagedserve.models.moe import ExpertWeights, MoESpec, MoEWeights, count_expert_reads, moe_forward, route
from pagedserve.models.ops import TorchOps

H, I, E, K = 64, 32, 8, 2


def _block(kind: str):
    """(transformers' block module with random weights, our MoESpec)."""
    torch.manual_seed(0)
    if kind == "qwen3_moe":
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
        cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=K,
                             norm_topk_prob=True)
        block, spec = Qwen3MoeSparseMoeBlock(cfg), MoESpec(E, K, I, norm_topk_prob=True)
    elif kind == "mixtral":
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
        cfg = MixtralConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=K)
        block, spec = MixtralSparseMoeBlock(cfg), MoESpec(E, K, I, norm_topk_prob=True)
    elif kind == "olmoe":
        from transformers import OlmoeConfig
        from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock
        cfg = OlmoeConfig(hidden_size=H, intermediate_size=I, num_experts=E, num_experts_per_tok=K)
        block, spec = OlmoeSparseMoeBlock(cfg), MoESpec(E, K, I, norm_topk_prob=False)
    elif kind == "qwen2_moe":
        from transformers import Qwen2MoeConfig
        from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
        cfg = Qwen2MoeConfig(hidden_size=H, moe_intermediate_size=I, shared_expert_intermediate_size=48,
                             num_experts=E, num_experts_per_tok=K, norm_topk_prob=False)
        block, spec = Qwen2MoeSparseMoeBlock(cfg), MoESpec(E, K, I, shared_intermediate_size=48)
    else:
        from transformers import GptOssConfig
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
        cfg = GptOssConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=K)
        block = GptOssMLP(cfg)
        spec = MoESpec(E, K, I, scoring="topk_softmax", activation="clamped_swiglu",
                       swiglu_alpha=cfg.swiglu_alpha, swiglu_limit=cfg.swiglu_limit)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.2)
    return block.eval(), spec


def _weights(block, kind: str) -> MoEWeights:
    """Our MoEWeights of the same numbers (float32)."""
    if kind == "gpt_oss":       # [E, H, 2I] with gate and up interleaved: ours is [2I, H], gate rows first
        ex, router = block.experts, block.router
        experts = [ExpertWeights(torch.cat([ex.gate_up_proj[e].T[0::2], ex.gate_up_proj[e].T[1::2]]).contiguous(),
                                 ex.down_proj[e].T.contiguous(),
                                 torch.cat([ex.gate_up_proj_bias[e][0::2], ex.gate_up_proj_bias[e][1::2]]),
                                 ex.down_proj_bias[e].clone())
                   for e in range(E)]
        return MoEWeights(router.weight.detach().float(), experts, router_bias=router.bias.detach().float())
    ex = block.experts
    experts = [ExpertWeights(ex.gate_up_proj[e].detach().clone(), ex.down_proj[e].detach().clone())
               for e in range(E)]
    w = MoEWeights(block.gate.weight.detach().float(), experts)
    if kind == "qwen2_moe":
        s = block.shared_expert
        w.shared = ExpertWeights(torch.cat([s.gate_proj.weight, s.up_proj.weight]).detach(),
                                 s.down_proj.weight.detach())
        w.shared_gate = block.shared_expert_gate.weight.detach()
    return w


def _hf(block, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = block(x.unsqueeze(0))
    return (out[0] if isinstance(out, tuple) else out)[0]       # gpt-oss's block also returns its scores


def _hidden(tokens: int, all_to_one: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, H, generator=g)
    return x.abs() if all_to_one else x


KINDS = ["qwen3_moe", "mixtral", "olmoe", "qwen2_moe", "gpt_oss"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tokens", [1, 3, 37])
@pytest.mark.parametrize("ops", [TorchOps(), CpuOps()], ids=["torch", "cpu"])
def test_block_matches_transformers(kind, tokens, ops):
    block, spec = _block(kind)
    w = _weights(block, kind)
    x = _hidden(tokens)
    ref = _hf(block, x)
    with count_expert_reads() as reads:
        ours = moe_forward(x, w, spec, ops)
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-4)
    _, ids = route(torch.nn.functional.linear(x, w.router, w.router_bias), spec)
    assert reads.experts() == set(ids.view(-1).tolist())
    if tokens == 3:
        assert len(reads.experts()) < E      # this batch leaves experts out: they were not run


@pytest.mark.parametrize("kind", ["qwen3_moe", "olmoe", "gpt_oss"])
def test_one_expert_gets_every_token(kind):
    block, spec = _block(kind)
    with torch.no_grad():              # expert 5's router row dominates any positive input
        router = block.router if kind == "gpt_oss" else block.gate
        router.weight[5] = 3.0
    w = _weights(block, kind)
    x = _hidden(16, all_to_one=True)
    ref = _hf(block, x)
    with count_expert_reads() as reads:
        ours = moe_forward(x, w, spec, CpuOps())
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-4)
    assert (5, 16) in {(e, n) for (_, e, n) in reads.calls[0]}


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0"])
@pytest.mark.parametrize("tokens", [1, 9, 40])
def test_quantized_experts(qtype, tokens):
    """Experts in GGUF blocks (gate and up apart, as a GGUF file's 3-D tensors hold them) against
    the float block over the same dequantized numbers."""
    block, spec = _block("qwen3_moe")
    w = _weights(block, "qwen3_moe")
    q = []
    for e in w.experts:
        gate, up = (quant.quantize(t.contiguous(), qtype) for t in e.gate_up.chunk(2))
        q.append(ExpertWeights((gate, up), quant.quantize(e.down, qtype)))
    deq = [ExpertWeights(torch.cat([quant.dequantize(p) for p in e.gate_up]), quant.dequantize(e.down)) for e in q]
    x = _hidden(tokens)
    ref = moe_forward(x, MoEWeights(w.router, deq), spec, TorchOps())
    ours = moe_forward(x, MoEWeights(w.router, q), spec, CpuOps())
    # the integer path quantizes activations to 8 bits: close, not equal
    torch.testing.assert_close(ours, ref, atol=0.05 * ref.abs().max().item(), rtol=0.05)


def test_one_token_runs_its_experts_gate_up_as_one_product(monkeypatch):
    """A decode token's quantized experts: gate/up of all k in one product, the same numbers as
    one product per expert (bit for bit), k + 1 kernel calls instead of 2 k."""
    from pagedserve.models import moe
    block, spec = _block("qwen3_moe")
    w = _weights(block, "qwen3_moe")
    experts = [ExpertWeights(tuple(quant.quantize(t.contiguous(), "q8_0") for t in e.gate_up.chunk(2)),
                             quant.quantize(e.down, "q8_0")) for e in w.experts]
    x = _hidden(1)
    calls = []
    ops = CpuOps()
    ops.routed_experts = lambda *a: None      # the experts one by one (where the ops have no kernel for them all)
    counted = lambda *a, **k: calls.append(a[1]) or ops.linear(*a, **k)      # noqa: E731
    fused = moe_forward(x, MoEWeights(w.router, experts), spec, ops, counted)
    assert len(calls) == K + 1 and len(calls[0]) == 2 * K
    monkeypatch.setattr(moe, "_quantized_parts", lambda weight: None)        # one expert at a time
    assert torch.equal(moe_forward(x, MoEWeights(w.router, experts), spec, ops), fused)


def test_unchosen_experts_are_not_read():
    """A decode step's block reads only its top-k experts: every other expert's blocks are made
    NaN (scales of 0xFFFF), and the output stays finite and equal."""
    block, spec = _block("qwen3_moe")
    w = _weights(block, "qwen3_moe")
    experts = [ExpertWeights(quant.quantize(e.gate_up, "q8_0"), quant.quantize(e.down, "q8_0")) for e in w.experts]
    x = _hidden(1)
    _, ids = route(torch.nn.functional.linear(x, w.router), spec)
    chosen = set(ids.view(-1).tolist())
    before = moe_forward(x, MoEWeights(w.router, experts), spec, CpuOps())
    for e, ex in enumerate(experts):
        if e not in chosen:
            for m in (ex.gate_up, ex.down):
                m.data.view(m.shape[0], -1, 34)[:, :, :2] = 0xFF      # each q8_0 block's fp16 scale: NaN
    with count_expert_reads() as reads:
        after = moe_forward(x, MoEWeights(w.router, experts), spec, CpuOps())
    assert reads.experts() == chosen and len(chosen) == K
    assert torch.isfinite(after).all()
    torch.testing.assert_close(after, before, atol=0, rtol=0)
    poisoned = next(iter(set(range(E)) - chosen))
    with pytest.raises(AssertionError):       # the poison does show where an expert is read
        y = moe_forward(x, MoEWeights(w.router, [experts[poisoned]] * E), spec, CpuOps())
        assert torch.isfinite(y).all()


def test_spec_checks_and_sparse_layers():
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        MoESpec(4, 5, 8)
    with pytest.raises(ValueError, match="scoring"):
        MoESpec(4, 2, 8, scoring="sigmoid")
    spec = MoESpec(8, 2, 16, decoder_sparse_step=2, mlp_only_layers=(3,))
    assert [spec.is_sparse(i) for i in range(6)] == [False, True, False, False, False, True]
