"""MXFP4 (OCP Microscaling, gpt-oss's expert format): blocks of 32 E2M1 values sharing one E8M0
scale. An E2M1 code is sign, 2 exponent bits and 1 mantissa bit (0, 0.5, 1, 1.5, 2, 3, 4, 6 and
their negatives); an E8M0 scale byte e is 2^(e - 127) (e = 255 is NaN). A value is code x scale.

Two byte layouts hold the same numbers:
- GGUF (llama.cpp's type MXFP4): 17 bytes a block, the scale byte, then 16 bytes whose low
  nibbles are elements 0-15 and high nibbles elements 16-31;
- HF safetensors (gpt-oss's `*_blocks` uint8 [..., G, 16] and `*_scales` uint8 [..., G]): the
  low nibble of byte j is element 2j, the high nibble element 2j + 1.
quant_format.py's type `mxfp4` keeps a matrix in the GGUF layout and kernels/csrc/quant/mxfp4.h
computes with it (gpt-oss's experts stay MXFP4 in memory on the CPU); elsewhere (a GPU) the loader
dequantizes them (exactly, in float32).
"""
from __future__ import annotations

import torch

BLOCK = 32
GGUF_BLOCK_BYTES = 17
# E2M1 codes 0-15 as numbers (bit 3: sign)
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def e8m0_scale(e: torch.Tensor) -> torch.Tensor:
    """2^(e - 127) as float32 for scale bytes e (255: NaN); exact down to 2^-127 (a subnormal)."""
    e = e.to(torch.int32)
    scale = torch.ldexp(torch.ones(e.shape, dtype=torch.float64), e - 127).float()
    return torch.where(e == 255, torch.full_like(scale, float("nan")), scale)


def dequantize_gguf(blocks: torch.Tensor) -> torch.Tensor:
    """GGUF MXFP4 blocks uint8 [..., n * 17] -> float32 [..., n * 32]."""
    shape = blocks.shape
    if shape[-1] % GGUF_BLOCK_BYTES:
        raise ValueError(f"MXFP4: {shape[-1]} bytes are not whole blocks of {GGUF_BLOCK_BYTES}")
    b = blocks.reshape(-1, GGUF_BLOCK_BYTES)
    qs = b[:, 1:].to(torch.int64)
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=1)                   # elements 0-15, then 16-31
    out = E2M1[codes] * e8m0_scale(b[:, 0])[:, None]
    return out.reshape(*shape[:-1], shape[-1] // GGUF_BLOCK_BYTES * BLOCK)


def dequantize_hf(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """gpt-oss's safetensors pair, blocks uint8 [..., G, 16] and scales uint8 [..., G] ->
    float32 [..., G * 32]."""
    if blocks.shape[-1] != 16 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4: blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match "
                         f"([..., G, 16] and [..., G])")
    qs = blocks.to(torch.int64)
    codes = torch.stack([qs & 0x0F, qs >> 4], dim=-1).flatten(-2)   # element 2j, then 2j + 1
    out = E2M1[codes] * e8m0_scale(scales)[..., None]
    return out.flatten(-2)


def hf_to_gguf(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The HF pair as GGUF MXFP4 blocks uint8 [..., G * 17] (the same numbers, nibbles regrouped),
    in uint8 throughout (scratch: two bytes per element of the input)."""
    if blocks.shape[-1] != 16 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4: blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match "
                         f"([..., G, 16] and [..., G])")
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2)   # [..., G, 32] in element order
    packed = codes[..., :16] | (codes[..., 16:] << 4)
    return torch.cat([scales.to(torch.uint8)[..., None], packed], dim=-1).flatten(-2)
