"""MXFP4 (pagedserve/mxfp4.py): dequantization exact against the format's definition, each E2M1 code
decoded from its bits ((-1)^s 2^(E-1) (1 + M/2), subnormal (-1)^s M/2) times 2^(e - 127), in both
byte layouts, and equal to the gguf package's (llama.cpp's) reading of its own MXFP4 blocks."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedserve import mxfp4


def _e2m1(code: int) -> float:
    sign = -1.0 if code & 8 else 1.0
    exp, man = (code >> 1) & 3, code & 1
    return sign * (man * 0.5 if exp == 0 else 2.0 ** (exp - 1) * (1 + man / 2))


def _definition(codes: np.ndarray, e: int) -> list[float]:
    """In float32 (whose range ends below 6 x 2^126: larger values are infinite there too)."""
    with np.errstate(over="ignore"):
        return [float(np.float32(_e2m1(int(c)) * 2.0 ** (e - 127))) for c in codes]


def test_e2m1_table_is_the_definition():
    assert mxfp4.E2M1.tolist() == [_e2m1(c) for c in range(16)]


def test_gguf_layout_exact():
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, size=(255, 17), dtype=np.uint8)
    blocks[:, 0] = np.arange(255)                  # every scale byte but NaN's, 2^-127 .. 2^127
    ours = mxfp4.dequantize_gguf(torch.from_numpy(blocks.reshape(-1)).view(5, -1)).reshape(255, 32)
    for b in range(255):
        qs = blocks[b, 1:]
        codes = np.concatenate([qs & 15, qs >> 4])
        assert ours[b].tolist() == _definition(codes, int(blocks[b, 0])), b
    from gguf import GGMLQuantizationType, quants
    with np.errstate(over="ignore"):
        theirs = quants.dequantize(blocks, GGMLQuantizationType.MXFP4).reshape(255, 32)
    np.testing.assert_array_equal(ours.numpy(), theirs)


def test_hf_layout_exact_and_repacked():
    rng = np.random.default_rng(1)
    blocks = torch.from_numpy(rng.integers(0, 256, size=(3, 4, 16), dtype=np.uint8))
    scales = torch.from_numpy(rng.integers(100, 150, size=(3, 4), dtype=np.uint8))
    ours = mxfp4.dequantize_hf(blocks, scales)
    assert ours.shape == (3, 128)
    for r in range(3):
        for g in range(4):
            qs = blocks[r, g].numpy()
            codes = np.stack([qs & 15, qs >> 4], axis=-1).reshape(-1)
            assert ours[r, g * 32:(g + 1) * 32].tolist() == _definition(codes, int(scales[r, g]))
    assert torch.equal(mxfp4.dequantize_gguf(mxfp4.hf_to_gguf(blocks, scales)), ours)


def test_nan_scale_and_bad_shapes():
    block = torch.zeros(17, dtype=torch.uint8)
    block[0], block[1] = 255, 0x21
    assert torch.isnan(mxfp4.dequantize_gguf(block)).all()
    with pytest.raises(ValueError, match="whole blocks"):
        mxfp4.dequantize_gguf(torch.zeros(16, dtype=torch.uint8))
    with pytest.raises(ValueError, match="do not match"):
        mxfp4.dequantize_hf(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(3, dtype=torch.uint8))


@pytest.mark.parametrize("variant", ["torch"] + __import__("pagedserve.kernels.quant", fromlist=["x"]).supported_variants())
def test_the_kernels_type_is_exact_and_its_dots_are_the_integers(variant):
    """quant_format's `mxfp4` (the GGUF layout) through each kernel variant: dequantized exactly as
    the definition for every scale byte but NaN's (subnormal scales included), a NaN scale NaN; a
    few rows' product equal to the float64 value of q8 activations times those numbers up to
    float32 summation order (and a bias added)."""
    import contextlib
    from pagedserve.kernels import quant
    rng = np.random.default_rng(2)
    blocks = rng.integers(0, 256, size=(255, 17), dtype=np.uint8)
    blocks[:, 0] = np.arange(255)
    raw = torch.from_numpy(blocks.reshape(15, 17 * 17))
    w = quant.from_gguf_blocks("mxfp4", raw, (15, 17 * 32))
    with (quant.using_variant(variant) if variant != "torch" else contextlib.nullcontext()):
        got = quant.dequantize(w) if variant != "torch" else quant.dequantize_torch(w)
        flat = got.reshape(255, 32)
        for b in range(255):
            qs = blocks[b, 1:]
            assert flat[b].tolist() == _definition(np.concatenate([qs & 15, qs >> 4]), int(blocks[b, 0])), b
        nan = raw.clone()
        nan[0, 0] = 255
        assert torch.isnan(quant.dequantize(quant.from_gguf_blocks("mxfp4", nan, (15, 17 * 32)))[0, :32]).all()
        if variant == "torch":
            return
        scales = rng.integers(110, 135, size=(40, 9), dtype=np.uint8)          # ordinary magnitudes
        codes = rng.integers(0, 256, size=(40, 9, 16), dtype=np.uint8)
        w = quant.from_gguf_blocks("mxfp4", torch.from_numpy(np.concatenate([scales[..., None], codes], -1)
                                                             .reshape(40, 9 * 17)), (40, 9 * 32))
        for tokens in (1, 3, 5, 9):
            x = torch.randn(tokens, 9 * 32, generator=torch.Generator().manual_seed(tokens))
            bias = torch.randn(40, generator=torch.Generator().manual_seed(7))
            y = quant.linear(x, w, bias, decode=True)
            ref = quant.reference_linear(x, w) + bias.double()
            scale = x.double().abs() @ quant.dequantize_torch(w).double().abs().T + 1
            assert ((y.double() - ref).abs() <= 1e-5 * scale).all(), (tokens, float((y.double() - ref).abs().max()))
