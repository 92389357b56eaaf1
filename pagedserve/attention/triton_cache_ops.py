"""Triton kernels that move KV data: write a step's K/V into their slots, copy whole blocks.

The cache of one layer is `[2, num_blocks, block_size, num_kv_heads, head_dim]`
(K then V); slot s is token s % block_size of physical block s // block_size.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.attention.triton_utils import check_device, next_pow2


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, cache_ptr, slot_ptr, num_tokens,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_c_kv, stride_c_block, stride_c_tok, stride_c_head,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_HD: tl.constexpr,
):
    """One program per BLOCK_T tokens, each token's heads and dims as one flat row."""
    # 64-bit offsets throughout (program ids are 32-bit): a cache can exceed 2**31 elements.
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    slot = tl.load(slot_ptr + t, mask=t < num_tokens, other=-1).to(tl.int64)   # < 0: padding, not stored
    hd = tl.arange(0, BLOCK_HD)
    h = hd // HEAD_DIM
    d = hd % HEAD_DIM
    mask = (slot >= 0)[:, None] & (hd < NUM_KV_HEADS * HEAD_DIM)[None, :]
    k = tl.load(k_ptr + t[:, None] * stride_kt + (h * stride_kh + d)[None, :], mask=mask)
    v = tl.load(v_ptr + t[:, None] * stride_vt + (h * stride_vh + d)[None, :], mask=mask)
    row = (slot // PAGE) * stride_c_block + (slot % PAGE) * stride_c_tok
    dst = cache_ptr + row[:, None] + (h * stride_c_head + d)[None, :]
    tl.store(dst, k, mask=mask)
    tl.store(dst + stride_c_kv, v, mask=mask)


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """kv_cache: [2, num_blocks, block_size, Hkv, D]; k, v: [T, Hkv, D]; slot_mapping: [T]
    (a negative slot skips its token, for batches padded to a captured size)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    k, v = _unit_last_stride(k), _unit_last_stride(v)
    assert kv_cache.stride(-1) == 1 and kv_cache.dtype == k.dtype == v.dtype
    check_device(_write_kv_kernel, k.device)
    block_hd = next_pow2(num_kv_heads * head_dim)
    block_t = max(1, min(next_pow2(num_tokens), 8192 // block_hd))
    _write_kv_kernel[(triton.cdiv(num_tokens, block_t),)](
        k, v, kv_cache, slot_mapping, num_tokens,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, PAGE=kv_cache.shape[2],
        BLOCK_T=block_t, BLOCK_HD=block_hd,
    )


@triton.jit
def _copy_blocks_kernel(
    src_ptr, dst_ptr, src_ids_ptr, dst_ids_ptr,
    stride_src_seg, stride_src_block, stride_dst_seg, stride_dst_block,
    BLOCK_NUMEL: tl.constexpr, CHUNK: tl.constexpr,
):
    """Program (pair, segment, chunk) copies CHUNK elements of one block of one
    segment (a layer's K or V). Offsets in 64 bits: seg * stride_src_seg alone passes
    2**31 in any cache of more than 2**31 elements (every real one)."""
    pair = tl.program_id(0)
    seg = tl.program_id(1).to(tl.int64)
    chunk = tl.program_id(2).to(tl.int64)
    src_block = tl.load(src_ids_ptr + pair).to(tl.int64)
    dst_block = tl.load(dst_ids_ptr + pair).to(tl.int64)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = offs < BLOCK_NUMEL
    x = tl.load(src_ptr + seg * stride_src_seg + src_block * stride_src_block + offs, mask=mask)
    tl.store(dst_ptr + seg * stride_dst_seg + dst_block * stride_dst_block + offs, x, mask=mask)


def copy_blocks(src: torch.Tensor, dst: torch.Tensor, pairs: list[tuple[int, int]]) -> None:
    """Copy block s of `src` to block d of `dst` for each (s, d), in every layer, K and V.

    Both are contiguous caches shaped [..., num_blocks, block_size, Hkv, D] (all layers
    [layers, 2, blocks, ...] or one layer [2, blocks, ...]) and agree on everything but
    the number of blocks. They may be one tensor (copy-on-write) or two on the same
    device, such as the cache and a staging buffer for swapping blocks to host memory.
    """
    if not pairs:
        return
    if not (src.is_contiguous() and dst.is_contiguous()) or src.dtype != dst.dtype \
            or src.shape[:-4] != dst.shape[:-4] or src.shape[-3:] != dst.shape[-3:]:
        raise ValueError(f"copy_blocks needs two contiguous caches of one layout; got {tuple(src.shape)} "
                         f"{src.dtype} and {tuple(dst.shape)} {dst.dtype}")
    block_numel = src.shape[-3] * src.shape[-2] * src.shape[-1]   # block_size * Hkv * D
    src3 = src.view(-1, src.shape[-4], block_numel)   # [segments (layer, K/V), blocks, elements]
    dst3 = dst.view(-1, dst.shape[-4], block_numel)
    src_ids = torch.tensor([s for s, _ in pairs], dtype=torch.int64, device=src.device)
    dst_ids = torch.tensor([d for _, d in pairs], dtype=torch.int64, device=dst.device)
    chunk = min(next_pow2(block_numel), 4096)
    check_device(_copy_blocks_kernel, src.device)
    _copy_blocks_kernel[(len(pairs), src3.shape[0], triton.cdiv(block_numel, chunk))](
        src3, dst3, src_ids, dst_ids,
        src3.stride(0), src3.stride(1), dst3.stride(0), dst3.stride(1),
        BLOCK_NUMEL=block_numel, CHUNK=chunk,
    )


def _unit_last_stride(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()
