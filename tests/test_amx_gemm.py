"""The AMX-BF16 GEMM (cpu_kernels.cpp amx_gemm, taken by linear_packed_bf16 from cpu.amx_min_rows()
rows where cpu.amx_in_use()): against a float64 reference of the same bf16 inputs, against the
vdpbf16ps tiles it replaces, under the quantized tile path, and in a bf16 engine against the
transformers oracle. Skipped where the CPU (or its kernel) gives no AMX."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.kernels import cpu, quant
from tests.conftest import PROMPTS, hf_greedy
from tests.test_quant_kernels import weight


@pytest.fixture
def amx():
    """The avx512bf16 kernels with AMX on from 1 row (restored after)."""
    if "avx512bf16" not in cpu.supported_variants():
        pytest.skip("this CPU lacks avx512_bf16 (the AMX path lives in that build)")
    with cpu.using_variant("avx512bf16"):
        with cpu.using_amx(True, 1) as on:
            if not on:
                pytest.skip(f"no AMX here: {cpu.describe_amx()}")
            yield


def _operands(m: int, n: int, k: int, bias: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) / k ** 0.5).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    return x, w, b


# Ragged everything: rows not a multiple of 16 or 32 (one, two and a partial A tile), columns
# not a multiple of 16 or 32 (masked stores, zero columns of the packing), K with a partial
# step of 32 (zero-padded A and B tiles) and K below one step.
SHAPES = [(1, 16, 32), (5, 33, 62), (16, 64, 64), (17, 40, 34), (33, 100, 130), (64, 576, 576), (100, 70, 2),
          (48, 96, 1536)]


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("bias", [False, True])
def test_amx_equals_float_reference(amx, m, n, k, bias):
    """Products of bf16 pairs are exact and sums float32: the output is the float64 product
    up to float32 summation order and the one rounding to bf16."""
    x, w, b = _operands(m, n, k, bias, seed=m * 1000 + n + k)
    out = cpu.linear(x, cpu.pack_weight(w), b)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    # one bf16 rounding (2^-9 relative) of the float32 sum, whose error is far below it
    assert ((out.double() - ref).abs() <= ref.abs() * 2 ** -8 + 1e-4).all()


def test_amx_is_its_own_path_and_the_threshold_holds(amx):
    """AMX and the vdpbf16ps tiles sum in different orders, so some outputs differ in the last
    bit (the AMX path really ran); below the threshold the vdpbf16ps tiles run (bit-equal to AMX off)."""
    x, w, b = _operands(64, 256, 1536, True, seed=7)
    packed = cpu.pack_weight(w)
    on = cpu.linear(x, packed, b)
    with cpu.using_amx(False):
        off = cpu.linear(x, packed, b)
    assert not torch.equal(on, off)
    torch.testing.assert_close(on.float(), off.float(), rtol=2 ** -7, atol=1e-3)
    with cpu.using_amx(True, 65):        # 64 rows: below the threshold
        assert torch.equal(cpu.linear(x, packed, b), off)


def test_the_switch(monkeypatch):
    """PAGEDSERVE_AMX=0 turns it off; the description says why it is off or from how many rows it runs."""
    monkeypatch.setenv(cpu.ENV_AMX, "0")
    with cpu.using_amx(None):
        assert not cpu.amx_in_use()
        assert "AMX" in cpu.describe_amx() and "from" not in cpu.describe_amx()
    monkeypatch.delenv(cpu.ENV_AMX)
    with cpu.using_amx(None):
        if cpu.amx_in_use():
            assert cpu.describe_amx() == f"AMX-BF16 GEMM from {cpu.AMX_MIN_ROWS} rows"
    assert "cpu_amx" in cpu.describe()


@pytest.mark.parametrize("qtype", quant.QTYPES)
@pytest.mark.parametrize("extra", [1, 28])
def test_quantized_tiles_over_amx(amx, qtype, extra, monkeypatch):
    """bf16 activations above the integer path's rows: weight tiles dequantized into the packed
    layout (two tiles, the last partial, and a second part stacked) and multiplied on AMX, each
    into its columns of y: exactly the AMX GEMM over the whole dequantized weight, and the
    float product of the same bf16 values."""
    monkeypatch.setattr(quant, "tile_rows", lambda cols: 32)
    w, _ = weight(qtype)                          # 37 rows
    w2, _ = weight(qtype, rows=21, seed=1)
    tokens = quant.batch_rows(bf16=True) + extra
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, w.shape[1], generator=g).bfloat16()
    bias = torch.randn(w.shape[0] + w2.shape[0], generator=g)
    y = quant.linear(x, [w, w2], bias)
    full = torch.cat([quant.dequantize_torch(w), quant.dequantize_torch(w2)]).bfloat16()
    assert torch.equal(y, cpu.linear(x, cpu.pack_weight(full), bias))
    ref = x.double() @ full.double().T + bias.double()
    assert ((y.double() - ref).abs() <= ref.abs() * 2 ** -8 + 1e-4).all()


def test_bf16_engine_prefill_on_amx_matches_transformers(tiny_llama):
    """A bf16 engine whose prefill chunk and decode rows run the AMX GEMM (threshold 4, as
    shipped): its greedy tokens are transformers' (float32) for the first tokens, as the bf16
    engine's are on the other kernels (tests/test_models.py)."""
    from pagedserve import LLM, SamplingParams
    if "avx512bf16" not in cpu.supported_variants():
        pytest.skip("this CPU lacks avx512_bf16 (the AMX path lives in that build)")
    with cpu.using_variant("avx512bf16"), cpu.using_amx(True):
        if not cpu.amx_in_use():
            pytest.skip(f"no AMX here: {cpu.describe_amx()}")
        llm = LLM(tiny_llama.path, dtype="bfloat16", num_gpu_blocks_override=256, block_size=16)
        assert llm.engine.runner.model.compiled_layers is not None
        prompts = [tiny_llama.tokenizer.encode(PROMPTS[i]) for i in (2, 5)]
        assert min(len(p) for p in prompts) >= cpu.amx_min_rows()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=6, min_tokens=6), use_tqdm=False)
        for p, out in zip(prompts, outs):
            assert out.outputs[0].token_ids[:4] == hf_greedy(tiny_llama.hf, p, 4)
