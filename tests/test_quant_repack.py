"""kernels/quant.py's repacked layout (quant.repack: q4_0 -> q4_0x8, units of 8 blocks whose
bytes are rearranged for the decode dots): the same values as the file's blocks on every path
(dequantize and embedding exactly gguf's; the integer dots the kernel's own arithmetic up to
float32 summation order, on vpdpbusd and AMX-INT8; the dequantized tiles bit for bit the file
layout's), for every variant; and the loader repacks a Q4_0 file's matrices it owns."""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf import quants as gq

from pagedserve.kernels import cpu, quant
from tests.test_quant_kernels import _check_small, amx_int8, check_rows_alone, variant, weight  # noqa: F401 (fixtures)


def repacked(rows: int = 37, cols: int = 256 * 5, seed: int = 0):
    w, raw = weight("q4_0", rows=rows, cols=cols, seed=seed)
    return quant.repack(w), w, raw


def test_repack_is_a_permutation_of_the_bytes(monkeypatch):
    x8, w, _ = repacked()
    assert x8.qtype == "q4_0x8" and x8.shape == w.shape and x8.nbytes == w.nbytes
    assert not torch.equal(x8.data, w.data)
    assert torch.equal(quant.file_layout(x8).data, w.data)
    # unit 0 of row 0: block l's d at 2l, its qs[8k + j] at byte 16 + 64k + 8l + j
    unit, blocks = x8.data[0, :144], w.data[0, :144].view(8, 18)
    assert torch.equal(unit[:16].view(8, 2), blocks[:, :2])
    assert torch.equal(unit[16:].view(2, 8, 8), blocks[:, 2:].reshape(8, 2, 8).transpose(0, 1))
    copy = w.data.clone()
    in_place = quant.repack(quant.QuantizedWeight("q4_0", w.shape, copy), in_place=True)
    assert in_place.data.data_ptr() == copy.data_ptr() and torch.equal(copy, x8.data)
    # nothing else is repacked: other types (q4_1: rows not a multiple of 8), widths not whole units, the switch off
    for other in (weight("q4_1", rows=12, cols=512)[0], weight("q4_0", cols=288)[0], weight("q8_0", cols=512)[0]):
        assert quant.repack(other) is other
    monkeypatch.setenv(quant.REPACK_ENV, "0")
    assert quant.repack(w) is w


def test_dequantize_and_embedding_match_gguf(variant):
    x8, _, raw = repacked()
    expected = torch.from_numpy(gq.dequantize(raw, GGMLQuantizationType.Q4_0))
    assert torch.equal(quant.dequantize(x8), expected)
    assert torch.equal(quant.dequantize_torch(x8), expected)
    ids = torch.tensor([[5, 0], [36, 5]])
    assert torch.equal(quant.embedding(x8, ids), expected[ids])


@pytest.mark.parametrize("tokens", [1, 2, 3, 9, 16])
@pytest.mark.parametrize("units", [1, 3, 5])
def test_linear_small_batches(variant, tokens, units):
    """1, 3 or 5 units, an odd row count (the T = 1 row pairs' tail), T across the passes of 4 or
    8 activation rows: the kernel's arithmetic, and the file layout's values."""
    x8, w, _ = repacked(cols=256 * units, seed=units)
    x = torch.randn(tokens, w.shape[1], generator=torch.Generator().manual_seed(tokens))
    y = quant.linear(x, x8, decode=True)
    if variant == "torch":
        torch.testing.assert_close(y, x @ quant.dequantize_torch(w).T, rtol=1e-4, atol=1e-5)
        return
    _check_small(y, x, x8)
    scale = x.abs() @ quant.dequantize_torch(w).abs().T
    assert ((y - quant.linear(x, w, decode=True)).abs() <= 1e-5 * scale + 1e-6).all()


def test_one_token_row_pairs_strided_and_stacked(variant):
    """T = 1 over rows strided in memory (a column slice of whole units), bias and bf16 out; and
    stacked with parts of other types (a pair never straddles two parts): each part's own product."""
    x8, w, _ = repacked(cols=256 * 5)
    cols = quant.slice_cols(x8, 256, 256 * 4)
    assert cols.qtype == "q4_0x8" and cols.data.stride(0) != cols.row_bytes
    x, bias, g = check_rows_alone(variant, cols, seed=3)
    y16 = quant.linear(x.bfloat16(), cols, bias)
    assert torch.equal(y16, quant.linear(x.bfloat16().float(), cols, bias).bfloat16())
    parts = [weight("q4_k", rows=9, cols=768, seed=1)[0], quant.slice_rows(cols, 0, 13),
             weight("q6_k", rows=4, cols=768, seed=2)[0], weight("q4_0", rows=7, cols=768, seed=3)[0]]
    for tokens in (1, 5):
        xs = torch.randn(tokens, 768, generator=g)
        stacked = quant.linear(xs, parts)
        torch.testing.assert_close(stacked, torch.cat([quant.linear(xs, p) for p in parts], dim=1),
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("extra", [1, 54])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_large_batches_equal_the_file_layout(variant, extra, dtype, monkeypatch):
    """The dequantized tiles (packed GEMM, AMX-BF16 weights as A, per-thread packing, as the
    batch picks): bit for bit the file layout's, and the packed GEMM over the whole weight."""
    monkeypatch.setattr(quant, "tile_rows", lambda cols: 32)
    x8, w, _ = repacked(cols=256 * 3)
    tokens = quant.batch_rows(False, dtype == torch.bfloat16) + extra
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, w.shape[1], generator=g).to(dtype)
    bias = torch.randn(w.shape[0], generator=g)
    y = quant.linear(x, x8, bias)
    assert torch.equal(y, quant.linear(x, w, bias))
    if variant != "torch" and cpu.load() is not None:
        assert torch.equal(y, cpu.linear(x, cpu.pack_weight(quant.dequantize_torch(w).to(dtype)), bias))


@pytest.mark.parametrize("tokens", [5, 16, 27])
def test_amx_int8_dots(amx_int8, tokens):  # noqa: F811
    x8, w, _ = repacked(cols=256 * 5)
    x = torch.randn(tokens, w.shape[1], generator=torch.Generator().manual_seed(tokens))
    y = quant.linear(x, x8, decode=True)
    _check_small(y, x, x8)
    scale = x.abs() @ quant.dequantize_torch(w).abs().T
    assert ((y - quant.linear(x, w, decode=True)).abs() <= 1e-5 * scale + 1e-6).all()


def test_the_loader_repacks_a_q4_0_files_owned_matrices(gguf_files, monkeypatch):
    """A Q4_0 file of whole units (hidden 256): the fused qkv / gate_up (copies the loader owns)
    come repacked, and the model's logits equal those of the file's layout (PAGEDSERVE_QUANT_REPACK=0)
    up to float32 summation order, through the compiled layer loop."""
    from pagedserve.attention.cpu_backend import CpuAttention
    from pagedserve.kernels.cpu_ops import CpuOps
    from pagedserve.models.loader import load_model
    from tests.test_compiled_quantized_layers import PROMPT
    from tests.test_models import paged_logits
    files, _, tok = gguf_files
    prompt = tok.encode(PROMPT)
    logits = {}
    r8 = quant.variant() in quant.R8_VARIANTS
    for on in ("1", "0"):
        monkeypatch.setenv(quant.REPACK_ENV, on)
        # q4_0r8 (the 256-bit variants) runs a prefill chunk on the integer GEMM in every step
        # (quant.batch_rows): the file's layout then on its integer dots too, over the same 8-bit activations
        monkeypatch.setattr(quant, "SMALL_BATCH_ROWS", 1 << 30 if r8 and on == "0" else quant.SMALL_BATCH_ROWS)
        model, _, _ = load_model(str(files["q4_0"]), "float32", CpuAttention(), ops=CpuOps(), quantization="gguf")
        model.pack_linear_weights()
        repacked = "q4_0r8" if quant.variant() in quant.R8_VARIANTS else "q4_0x8"
        assert model.layers[0].qkv.qtype == (repacked if on == "1" else "q4_0")
        assert model.layers[0].gate_up.qtype == model.layers[0].qkv.qtype
        logits[on] = [paged_logits(model, prompt, chunk, block=16) for chunk in (len(prompt), 1)]
    # prefill off the 256-bit variants (the dequantized tiles): the same values. On the integer path
    # (one token a step; every prefill on the 256-bit variants): float32 sums in another order (~1e-7),
    # which now and then moves an activation's 8-bit rounding in a later projection by one step (seen:
    # a 3e-7 change of o's input, 9e-4 of its output; with the same input the outputs are equal):
    # close, the same greedy tokens but at near-ties.
    if not r8:
        torch.testing.assert_close(logits["1"][0], logits["0"][0], atol=1e-4, rtol=0)
    for new, old in zip(logits["1"][int(not r8):], logits["0"][int(not r8):]):
        assert float((new - old).norm() / old.norm()) < 1e-2
        rows = torch.arange(old.shape[0])
        gap = old[rows, old.argmax(-1)] - old[rows, new.argmax(-1)]     # 0 where both pick the same token
        assert (gap < 0.05).all(), gap.max()


from tests.test_compiled_quantized_layers import gguf_files  # noqa: E402,F401 (a fixture)
from tests.test_quantized_models import base_model  # noqa: E402,F401 (a fixture)
