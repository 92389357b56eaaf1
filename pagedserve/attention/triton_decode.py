"""Paged decode attention in Triton: one query token per sequence over its cached blocks.

Program (sequence, KV head, split) loads the query rows of every query head that shares
the KV head (GQA: one load of K/V serves the whole group) and walks its part of the
context in tiles of BLOCK_N tokens, finding each token's physical block through the block
table, with an online softmax. The launch has num_splits programs per (sequence, head),
chosen from the batch and the GPU's size (enough programs to keep every SM busy), never
from the context length: each sequence splits its own context into num_splits partitions
(of at least MIN_PARTITION tokens, so a short one uses fewer), so a CUDA graph captured
once serves every context length at full width. With one split the kernel writes the
output directly; otherwise each partition writes its normalised partial output and
log-sum-exp, and a second kernel merges them.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.attention.triton_utils import (LOG2E, attend_tile, check_device, check_sinks, check_window,
                                               dot_precision, load_kv_tile, next_pow2, sink_start, upcast)
from pagedserve.utils import cdiv

BLOCK_N = 64                # context tokens per tile
MIN_PARTITION = 256         # never split finer than this many tokens (a multiple of BLOCK_N)
MAX_PARTITIONS = 64         # at most this many splits per (sequence, head)
# Launch settings. For sm_90 at head dim 128 these compile without register spills
# (~120 registers); benchmarks/gpu_check.py times alternatives on a real GPU.
NUM_WARPS = 4
NUM_STAGES = 3              # K/V tiles in flight (software pipelining of the loop)


@triton.jit
def _window_first(seq_len, window):
    """The first token a decode query reads: seq_len - window inside a sliding window, else 0."""
    return tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)


@triton.jit
def _partition_tokens(seq_len, num_splits, BLOCK_N: tl.constexpr, MIN_PART: tl.constexpr):
    """Tokens per partition of one sequence (partition_tokens below, in Triton)."""
    per_split = (seq_len + num_splits - 1) // num_splits
    return tl.maximum((per_split + BLOCK_N - 1) // BLOCK_N * BLOCK_N, MIN_PART)


def partition_tokens(seq_len: int, num_splits: int, block_n: int = BLOCK_N, min_part: int = MIN_PARTITION) -> int:
    """Tokens per partition of a sequence of seq_len tokens split num_splits ways: its
    share, rounded up to whole tiles, and at least min_part (so at most num_splits
    partitions hold tokens, and a short context fewer)."""
    per_split = cdiv(seq_len, num_splits)
    return max(cdiv(per_split, block_n) * block_n, min_part)


@triton.jit
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, sinks_ptr,
    out_ptr, part_out_ptr, part_lse_ptr,
    qk_scale,                                   # softmax scale * log2(e): exp2 below
    softcap2,                                   # soft-cap * log2(e) (with SOFTCAP)
    window,                                     # sliding window in tokens (0: full attention)
    num_splits,                                 # programs per (sequence, KV head): a runtime value
    stride_qt, stride_qh,
    stride_c_block, stride_c_tok, stride_c_head,
    stride_bt,
    stride_ot, stride_oh,
    stride_ps, stride_pp, stride_ph,            # partial outputs: [seq, partition, head, D]
    stride_ls, stride_lp,                       # partial lse: [seq, partition, head]
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, MIN_PART: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr, NUM_STAGES: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    # 64-bit offsets (program ids are 32-bit); the cache's are in load_kv_tile.
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    part = tl.program_id(2).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + seq)
    # The query (position seq_len - 1) reads tokens first..seq_len - 1: its window's only (the
    # table's entries before the window's first block are -1 and never read).
    first = _window_first(seq_len, window)
    partition = _partition_tokens(seq_len - first, num_splits, BLOCK_N, MIN_PART)
    start = first + part * partition
    end = tl.minimum(start + partition, seq_len)   # empty when start >= seq_len

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + g
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i, l_i = sink_start(sinks_ptr, heads, g_mask, part == 0, BLOCK_G, HAS_SINKS)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq * stride_bt
    # Whole tiles without masks, then the partition's last, partial tile (if any).
    full_end = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N
    for n0 in tl.range(start, full_end, BLOCK_N, num_stages=NUM_STAGES):
        n = n0 + tl.arange(0, BLOCK_N)
        k, v = load_kv_tile(k_cache_ptr, v_cache_ptr, table, n, None, d, d_mask, kv_head,
                            stride_c_block, stride_c_tok, stride_c_head, PAGE, False, UPCAST)
        m_i, l_i, acc = attend_tile(q, k, v, True, m_i, l_i, acc, qk_scale, softcap2, PRECISION, SOFTCAP)
    for n0 in tl.range(full_end, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_mask = n < end
        k, v = load_kv_tile(k_cache_ptr, v_cache_ptr, table, n, n_mask, d, d_mask, kv_head,
                            stride_c_block, stride_c_tok, stride_c_head, PAGE, True, UPCAST)
        m_i, l_i, acc = attend_tile(q, k, v, n_mask[None, :], m_i, l_i, acc, qk_scale, softcap2, PRECISION,
                                    SOFTCAP)

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
    window, num_splits,
    stride_ps, stride_pp, stride_ph, stride_ls, stride_lp, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr, MIN_PART: tl.constexpr,
):
    """Program (sequence, query head): weight each partition by exp(its lse - max)."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    full_len = tl.load(seq_lens_ptr + seq)
    seq_len = full_len - _window_first(full_len, window)      # the tokens the partitions share
    partition = _partition_tokens(seq_len, num_splits, BLOCK_N, MIN_PART)
    num_parts = (seq_len + partition - 1) // partition
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


def choose_splits(max_seq_len: int, num_seqs: int, num_kv_heads: int, num_sms: int) -> int:
    """Programs per (sequence, KV head). One, unless the (sequence, KV head) programs are
    too few to keep every SM busy twice over: then enough splits that they are, at most
    MAX_PARTITIONS, and no more than the longest context (max_seq_len, a bound: a CUDA
    graph passes max_model_len) can fill with MIN_PARTITION tokens each. For contexts
    longer than MIN_PARTITION x the SM-derived count, the result does not depend on
    max_seq_len at all."""
    programs = num_seqs * num_kv_heads
    splits = min(triton.cdiv(2 * num_sms, programs), triton.cdiv(max(max_seq_len, 1), MIN_PARTITION), MAX_PARTITIONS)
    return max(splits, 1)


def decode_grid(num_seqs: int, num_kv_heads: int, num_splits: int) -> tuple[int, int, int]:
    """The decode kernel's launch grid: (sequence, KV head, split)."""
    return num_seqs, num_kv_heads, num_splits


def device_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def paged_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float, max_seq_len: int,
                           out: torch.Tensor | None = None, num_splits: int | None = None,
                           window: int | None = None, softcap: float = 0.0,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [N, Hq, D], one query per sequence, whose K/V are already in the cache;
    kv_cache: [2, num_blocks, block_size, Hkv, D]; block_tables: [N, >= blocks needed];
    seq_lens: [N] (max_seq_len bounds them; only the choice of splits reads it, so a
    captured CUDA graph can pass max_model_len). Returns out [N, Hq, D].

    window: each query reads its last `window` tokens only (a KV group's sliding window: the
    table's entries before the window's first block may be -1); softcap: scores capped at
    +-softcap (cap * tanh(s / cap); 0: none); sinks [Hq]: a logit per head in the softmax's
    denominator (gpt-oss).

    num_splits: programs per (sequence, KV head), each over its share of the sequence's
    context; by default choose_splits() decides (1: no split, no merge).
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
    if num_splits is None:
        num_splits = choose_splits(max_seq_len, num_seqs, num_kv_heads, device_sms(q.device))
    if not 1 <= num_splits <= MAX_PARTITIONS:
        raise ValueError(f"num_splits must be 1..{MAX_PARTITIONS}, got {num_splits}")
    split = num_splits > 1
    group = num_heads // num_kv_heads
    if split:
        part_out = torch.empty(num_seqs, num_splits, num_heads, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(num_seqs, num_splits, num_heads, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out          # unused
    check_device(_decode_kernel, q.device)
    window = check_window(window)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    sinks = check_sinks(sinks, num_heads, q.device)
    _decode_kernel[decode_grid(num_seqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, sinks if sinks is not None else q,
        out, part_out, part_lse,
        scale * LOG2E, softcap * LOG2E if softcap else 1.0, window, num_splits,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        *(part_out.stride()[:3] if split else (0, 0, 0)),
        *(part_lse.stride()[:2] if split else (0, 0)),
        GROUP=group, BLOCK_G=max(16, next_pow2(group)),   # query rows padded to 16 for tl.dot on tensor cores
        HEAD_DIM=head_dim, BLOCK_D=next_pow2(head_dim),
        PAGE=kv_cache.shape[2], BLOCK_N=BLOCK_N, SPLIT=split, MIN_PART=max(MIN_PARTITION, BLOCK_N),
        UPCAST=upcast(_decode_kernel, q.dtype), PRECISION=dot_precision(q.dtype),
        NUM_STAGES=NUM_STAGES, SOFTCAP=bool(softcap), HAS_SINKS=sinks is not None, num_warps=NUM_WARPS,
    )
    if split:
        check_device(_merge_kernel, q.device)
        _merge_kernel[(num_seqs, num_heads)](
            part_out, part_lse, seq_lens, out, window, num_splits,
            *part_out.stride()[:3], *part_lse.stride()[:2], out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=next_pow2(head_dim), BLOCK_P=next_pow2(num_splits),
            BLOCK_N=BLOCK_N, MIN_PART=max(MIN_PARTITION, BLOCK_N),
        )
    return out
