"""kernels/quant.py: GGUF block formats decoded exactly as gguf.quants does, and linear layers
over them, for every kernel variant this CPU supports: the small-batch integer path against
the float64 value of its own arithmetic (q8 activations times the dequantized weight), both
paths against the float product."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGML_QUANT_SIZES
from gguf import quants as gq

from pagedserve.kernels import cpu, quant

GGUF_TYPE = {q: getattr(GGMLQuantizationType, q.upper()) for q in quant.QTYPES}
VARIANTS = ["torch"] + quant.supported_variants()
ROWS = 37


def cols_for(qtype: str) -> int:
    return 288 if quant.BLOCK[qtype] == 32 else 768


def random_blocks(qtype: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """uint8 [rows, row_bytes] of valid blocks: gguf's quantizer where it has one, else random
    quants with small random fp16 scales (K-quants)."""
    rng = np.random.default_rng(seed)
    if qtype in ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0"):
        x = rng.standard_normal((rows, cols)).astype(np.float32) * 0.05 + rng.standard_normal((rows, 1)) * 0.01
        return gq.quantize(x.astype(np.float32), GGUF_TYPE[qtype])
    nb, bb = cols // 256, quant.BLOCK_BYTES[qtype]
    blocks = rng.integers(0, 256, size=(rows, nb, bb), dtype=np.uint8)

    def f16(n):
        return (rng.uniform(0.0005, 0.004, size=(rows, nb, 1)).astype(np.float16)).view(np.uint8)
    if qtype in ("q4_k", "q5_k"):
        blocks[..., 0:2], blocks[..., 2:4] = f16(1), f16(1)
    else:
        blocks[..., 208:210] = f16(1)
    return blocks.reshape(rows, nb * bb)


def weight(qtype: str, rows: int = ROWS, cols: int | None = None, seed: int = 0) -> tuple[quant.QuantizedWeight, np.ndarray]:
    cols = cols or cols_for(qtype)
    raw = random_blocks(qtype, rows, cols, seed)
    return quant.from_gguf_blocks(qtype, torch.from_numpy(raw), (rows, cols)), raw


@pytest.fixture(params=VARIANTS)
def variant(request, monkeypatch):
    if request.param == "torch":
        monkeypatch.setattr(quant, "load", lambda: None)
        yield "torch"
    else:
        with quant.using_variant(request.param) as lib:
            assert lib is not None, f"variant {request.param} did not build"
            assert lib.quant_kernel_variant().decode() == request.param
            yield request.param


def test_block_sizes_match_gguf():
    for q in quant.QTYPES:
        assert (quant.BLOCK[q], quant.BLOCK_BYTES[q]) == GGML_QUANT_SIZES[GGUF_TYPE[q]]


@pytest.mark.parametrize("qtype", quant.QTYPES)
def test_dequantize_matches_gguf(variant, qtype):
    w, raw = weight(qtype)
    expected = torch.from_numpy(gq.dequantize(raw, GGUF_TYPE[qtype]))
    assert torch.equal(quant.dequantize(w), expected)
    assert quant.dequantize(w, torch.bfloat16).dtype == torch.bfloat16


def _check_small(y: torch.Tensor, x: torch.Tensor, w: quant.QuantizedWeight, bias=None):
    """y against the float64 value of the kernel's own arithmetic: equal up to float32
    summation order; and close to the float product."""
    ref = quant.reference_linear(x, w)
    q, d = quant.quantize_activations(x)
    x8 = (q.double().view(x.shape[0], -1, 32) * d.double().unsqueeze(-1)).view(x.shape)
    scale = x8.abs() @ quant.dequantize_torch(w).double().abs().T
    if bias is not None:
        ref = ref + bias.double()
    err = (y.double() - ref).abs()
    assert (err <= 1e-5 * scale + 1e-7).all(), float((err / (scale + 1e-30)).max())
    exact = x.double() @ quant.dequantize_torch(w).double().T + (0 if bias is None else bias.double())
    assert float((y.double() - exact).norm() / exact.norm()) < 2e-2


@pytest.mark.parametrize("qtype", quant.QTYPES)
@pytest.mark.parametrize("tokens", [1, 3, 9, 16])
def test_linear_small_batches(variant, qtype, tokens):
    w, _ = weight(qtype)
    x = torch.randn(tokens, w.shape[1], generator=torch.Generator().manual_seed(tokens))
    y = quant.linear(x, w)
    assert y.shape == (tokens, ROWS) and y.dtype == torch.float32
    if variant == "torch":
        torch.testing.assert_close(y, x @ quant.dequantize_torch(w).T, rtol=1e-4, atol=1e-5)
    else:
        _check_small(y, x, w)


@pytest.mark.parametrize("qtype", quant.QTYPES)
@pytest.mark.parametrize("tokens", [17, 70])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_large_batches(variant, qtype, tokens, dtype, monkeypatch):
    """Dequantized tiles through cpu.py's packed GEMM: exactly that GEMM over the whole
    dequantized (bf16-rounded) weight, packed by cpu.pack_weight."""
    monkeypatch.setattr(quant, "tile_rows", lambda cols: 32)          # two tiles, the last partial
    w, _ = weight(qtype)
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, w.shape[1], generator=g).to(dtype)
    bias = torch.randn(ROWS, generator=g)
    y = quant.linear(x, w, bias)
    assert y.dtype == dtype and y.shape == (tokens, ROWS)
    full = quant.dequantize_torch(w)
    if variant != "torch" and cpu.load() is not None:
        assert torch.equal(y, cpu.linear(x, cpu.pack_weight(full.to(dtype)), bias))
    exact = x.float() @ full.T + bias
    if dtype == torch.float32:
        torch.testing.assert_close(y, exact, rtol=1e-4, atol=1e-4)
    else:                                               # bf16 weights and outputs: ~3 significant digits
        assert float((y.float() - exact).norm() / exact.norm()) < 1e-2


@pytest.mark.parametrize("qtype", ["q4_0", "q6_k"])
def test_linear_large_batches_without_packed_gemm(qtype, monkeypatch):
    """Where cpu.py's kernels are missing: float32 scratch tiles and torch.matmul."""
    monkeypatch.setattr(quant, "tile_rows", lambda cols: 16)
    monkeypatch.setattr(cpu, "_kernel", lambda name, x: None)
    w, _ = weight(qtype)
    x = torch.randn(20, w.shape[1]).bfloat16()
    exact = x.float() @ quant.dequantize_torch(w).T
    assert float((quant.linear(x, w).float() - exact).norm() / exact.norm()) < 1e-2


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0", "q4_k", "q6_k"])
def test_bias_and_bf16(variant, qtype):
    w, _ = weight(qtype)
    g = torch.Generator().manual_seed(5)
    bias = torch.randn(ROWS, generator=g)
    for tokens in (2, quant.SMALL_BATCH_ROWS):         # large batches: test_linear_large_batches
        x = torch.randn(tokens, w.shape[1], generator=g).bfloat16()
        y = quant.linear(x, w, bias)
        assert y.dtype == torch.bfloat16
        y32 = quant.linear(x.float(), w, bias)
        assert torch.equal(y, y32.bfloat16())          # bf16 in: exact in float32; out: rounded once
        if variant != "torch":
            _check_small(y32, x.float(), w, bias)


@pytest.mark.parametrize("qtype", ["q4_1", "q5_k", "q6_k"])
def test_slices(variant, qtype):
    w, _ = weight(qtype, rows=40, cols=2 * cols_for(qtype))
    full = quant.dequantize_torch(w)
    block = quant.BLOCK[qtype]
    rows = quant.slice_rows(w, 8, 29)
    cols = quant.slice_cols(w, block, w.shape[1] - block)
    assert rows.shape == (21, w.shape[1]) and cols.shape == (40, w.shape[1] - 2 * block)
    assert rows.data.data_ptr() == w.data[8].data_ptr()          # views, no copies
    assert torch.equal(quant.dequantize(rows), full[8:29])
    assert torch.equal(quant.dequantize(cols), full[:, block:-block])
    x = torch.randn(3, cols.shape[1])
    y = quant.linear(x, cols)
    if variant == "torch":
        torch.testing.assert_close(y, x @ full[:, block:-block].T, rtol=1e-4, atol=1e-4)
    else:
        _check_small(y, x, cols)
    torch.testing.assert_close(quant.linear(x.repeat(7, 1), cols), x.repeat(7, 1) @ full[:, block:-block].T,
                               rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError):
        quant.slice_cols(w, 0, block // 2)
    with pytest.raises(ValueError):
        quant.slice_rows(w, 30, 50)
    assert rows.nbytes == 21 * w.row_bytes


@pytest.mark.parametrize("qtype", quant.QUANTIZE_TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_matches_gguf(qtype, dtype):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(37, 256, generator=g) * torch.rand(37, 1, generator=g)).to(dtype)
    x[3] = 0                                                     # an all-zero row: d = 0
    x[4, :32] = torch.tensor([1.0, -1.0] * 16)
    w = quant.quantize(x, qtype)
    expected = gq.quantize(x.float().numpy(), GGUF_TYPE[qtype])
    assert np.array_equal(w.data.numpy(), expected)
    assert w.shape == (37, 256) and w.nbytes == expected.nbytes


def test_refusals():
    with pytest.raises(ValueError):
        quant.from_gguf_blocks("q4_0", torch.zeros(2, 18, dtype=torch.uint8), (2, 48))
    with pytest.raises(ValueError):
        quant.QuantizedWeight("q2_k", (1, 256), torch.zeros(1, 84, dtype=torch.uint8))
    with pytest.raises(ValueError):
        quant.quantize(torch.zeros(2, 64), "q4_k")
    flat = quant.from_gguf_blocks("q8_0", torch.zeros(2 * 68, dtype=torch.uint8), (2, 64))
    assert flat.data.shape == (2, 68)


def test_variant_choice(monkeypatch):
    info = quant.describe()
    assert info["quant_kernels"] in quant.supported_variants()
    assert set(info["quant_paths"]) == set(quant.QTYPES)
    monkeypatch.setenv(quant.ENV_VARIANT, "scalar")
    assert quant.choose_variant() == "scalar"
    monkeypatch.setenv(quant.ENV_VARIANT, "nonsense")
    with pytest.raises(ValueError):
        quant.choose_variant()
