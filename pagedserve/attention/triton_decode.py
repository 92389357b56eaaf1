"""Paged decode attention in Triton: one query token per sequence over its cached blocks.

Program (sequence, KV head, partition) loads the query rows of every query head
that shares the KV head (GQA: one load of K/V serves the whole group) and walks
its part of the context in tiles of BLOCK_N tokens, finding each token's physical
block through the block table, with an online softmax. Short contexts use one
partition and write the output directly. Long contexts, when there are too few
(sequence, head) programs to fill the GPU, are split over the sequence length:
each partition writes its normalised partial output and log-sum-exp, and a second
kernel merges the partitions.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.attention.triton_utils import (attend_tile, check_device, dot_precision, load_kv_tile, next_pow2,
                                               upcast)

BLOCK_N = 64                # context tokens per tile
MIN_PARTITION = 256         # never split finer than this many tokens
MAX_PARTITIONS = 64
# Launch settings. For sm_90 at head dim 128 these compile without register spills
# (~120 registers); benchmarks/gpu_check.py times alternatives on a real GPU.
NUM_WARPS = 4
NUM_STAGES = 3              # K/V tiles in flight (software pipelining of the loop)


@triton.jit
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, part_out_ptr, part_lse_ptr,
    qk_scale,                                   # softmax scale * log2(e): exp2 below
    partition_size,
    stride_qt, stride_qh,
    stride_c_block, stride_c_tok, stride_c_head,
    stride_bt,
    stride_ot, stride_oh,
    stride_ps, stride_pp, stride_ph,            # partial outputs: [seq, partition, head, D]
    stride_ls, stride_lp,                       # partial lse: [seq, partition, head]
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    start = part * partition_size
    end = tl.minimum(start + partition_size, seq_len)   # empty when start >= seq_len

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq * stride_bt
    # Whole tiles without masks, then the partition's last, partial tile (if any).
    full_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N
    for n0 in tl.range(start, full_end, BLOCK_N, num_stages=NUM_STAGES):
        n = n0 + tl.arange(0, BLOCK_N)
        k, v = load_kv_tile(k_cache_ptr, v_cache_ptr, table, n, None, d, d_mask, kv_head,
                            stride_c_block, stride_c_tok, stride_c_head, PAGE, False, UPCAST)
        m_i, l_i, acc = attend_tile(q, k, v, True, m_i, l_i, acc, qk_scale, PRECISION)
    for n0 in tl.range(full_end, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < end
        k, v = load_kv_tile(k_cache_ptr, v_cache_ptr, table, n, n_mask, d, d_mask, kv_head,
                            stride_c_block, stride_c_tok, stride_c_head, PAGE, True, UPCAST)
        m_i, l_i, acc = attend_tile(q, k, v, n_mask[None, :], m_i, l_i, acc, qk_scale, PRECISION)

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    o_mask = g_mask[:, None] & d_mask[None, :]
    if SPLIT:
        # A partition past the sequence's end stores nothing (where, not `&`: see write_kv).
        live = start < seq_len
        base = seq * stride_ps + part * stride_pp + heads * stride_ph
        tl.store(part_out_ptr + base[:, None] + d[None, :], out, mask=tl.where(live, o_mask, False))
        tl.store(part_lse_ptr + seq * stride_ls + part * stride_lp + heads,
                 m_i + tl.log2(l_safe), mask=tl.where(live, g_mask, False))
    else:
        tl.store(out_ptr + seq * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def _merge_kernel(
    part_out_ptr, part_lse_ptr, seq_lens_ptr, out_ptr,
    partition_size,
    stride_ps, stride_pp, stride_ph, stride_ls, stride_lp, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """Program (sequence, query head): weight each partition by exp(its lse - max)."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    num_parts = (seq_len + partition_size - 1) // partition_size
    p = tl.arange(0, BLOCK_P)
    d = tl.arange(0, BLOCK_D)
    p_mask = p < num_parts
    lse = tl.load(part_lse_ptr + seq * stride_ls + p * stride_lp + head, mask=p_mask, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))
    w = tl.where(p_mask, w, 0.0)
    parts = tl.load(part_out_ptr + (seq * stride_ps + p * stride_pp + head * stride_ph)[:, None] + d[None, :],
                    mask=p_mask[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
    out = tl.sum(parts * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + seq * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


def choose_partition(max_seq_len: int, num_seqs: int, num_kv_heads: int, num_sms: int) -> int:
    """Tokens per partition (a multiple of BLOCK_N). The whole context, unless the
    (sequence, KV head) programs are too few to keep every SM busy twice over: then
    split long contexts so that they are, in partitions of at least MIN_PARTITION."""
    programs = num_seqs * num_kv_heads
    splits = min(triton.cdiv(2 * num_sms, programs), triton.cdiv(max_seq_len, MIN_PARTITION), MAX_PARTITIONS)
    splits = max(splits, 1)
    return triton.cdiv(triton.cdiv(max_seq_len, splits), BLOCK_N) * BLOCK_N


def paged_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float, max_seq_len: int,
                           out: torch.Tensor | None = None, partition_size: int | None = None) -> torch.Tensor:
    """q: [N, Hq, D], one query per sequence, whose K/V are already in the cache;
    kv_cache: [2, num_blocks, block_size, Hkv, D]; block_tables: [N, >= blocks needed];
    seq_lens: [N] (max_seq_len bounds them: it sizes the launch, so a captured CUDA graph
    can pass a fixed upper bound). Returns out [N, Hq, D].

    partition_size: tokens per partition (a multiple of BLOCK_N); by default
    choose_partition() decides, and one partition covering max_seq_len means no split.
    """
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[3]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not divide into {num_kv_heads} KV heads")
    if out is None:
        out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    assert q.stride(-1) == 1 and out.stride(-1) == 1 and kv_cache.stride(-1) == 1
    if partition_size is None:
        num_sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 1
        partition_size = choose_partition(max_seq_len, num_seqs, num_kv_heads, num_sms)
    if partition_size % BLOCK_N:
        raise ValueError(f"partition_size must be a multiple of {BLOCK_N}, got {partition_size}")
    num_parts = triton.cdiv(max(max_seq_len, 1), partition_size)
    split = num_parts > 1
    group = num_heads // num_kv_heads
    if split:
        part_out = torch.empty(num_seqs, num_parts, num_heads, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(num_seqs, num_parts, num_heads, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out          # unused
    check_device(_decode_kernel, q.device)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _decode_kernel[(num_seqs, num_kv_heads, num_parts)](
        q, k_cache, v_cache, block_tables, seq_lens,
        out, part_out, part_lse,
        scale * 1.4426950408889634, partition_size,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        *(part_out.stride()[:3] if split else (0, 0, 0)),
        *(part_lse.stride()[:2] if split else (0, 0)),
        GROUP=group, BLOCK_G=max(16, next_pow2(group)),   # query rows padded to 16 for tl.dot on tensor cores
        HEAD_DIM=head_dim, BLOCK_D=next_pow2(head_dim),
        PAGE=kv_cache.shape[2], BLOCK_N=BLOCK_N, SPLIT=split,
        UPCAST=upcast(_decode_kernel, q.dtype), PRECISION=dot_precision(q.dtype),
        NUM_STAGES=NUM_STAGES, num_warps=NUM_WARPS,
    )
    if split:
        check_device(_merge_kernel, q.device)
        _merge_kernel[(num_seqs, num_heads)](
            part_out, part_lse, seq_lens, out,
            partition_size,
            *part_out.stride()[:3], *part_lse.stride()[:2], out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=next_pow2(head_dim), BLOCK_P=next_pow2(num_parts),
        )
    return out
