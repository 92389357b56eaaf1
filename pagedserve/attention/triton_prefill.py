"""Paged prefill attention in Triton: variable-length query chunks, no padding.

Sequence i's queries are tokens query_start_loc[i]:query_start_loc[i+1] of the flat
batch, the last ones of its seq_lens[i] context tokens. Their K/V, and those of any
cached prefix, are already in the paged cache, so program (query tile, sequence,
query head) reads every key through the block table and attends causally: query j
of the chunk (position prefix + j) sees keys 0..prefix + j (within a sliding window W:
prefix + j - W + 1..prefix + j). Keys past the tile's last query, and before its first
query's window, are never loaded.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.attention.triton_utils import (LOG2E, attend_tile, check_device, check_sinks, check_window,
                                               dot_precision, load_kv_tile, next_pow2, sink_start, upcast)

BLOCK_M = 64    # queries per tile
BLOCK_N = 64    # keys per tile
NUM_WARPS = 8   # sm_90, head dim 128: ~170 registers, no spills
NUM_STAGES = 2
# Head dims above 128 (Gemma 2 / 3: 256): the tiles above need 257 KiB of shared memory there,
# past the 227 KiB an H100 gives a block (Triton refuses the launch); these take 69 KiB and
# 184-196 registers without spills (sm_90, Triton 3.6's ptxas).
WIDE = dict(BLOCK_M=32, BLOCK_N=32, NUM_WARPS=8, NUM_STAGES=2)


def tile_settings(head_dim: int) -> dict:
    """The launch's tile sizes, warps and pipeline stages for a head dim."""
    if next_pow2(head_dim) > 128:
        return WIDE
    return dict(BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, NUM_WARPS=NUM_WARPS, NUM_STAGES=NUM_STAGES)


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, sinks_ptr, out_ptr,
    qk_scale, softcap2, window, first_seq,
    stride_qt, stride_qh,
    stride_c_block, stride_c_tok, stride_c_head,
    stride_bt,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    NUM_STAGES: tl.constexpr, SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_WINDOW: tl.constexpr,
):
    # 64-bit offsets (program ids are 32-bit); the cache's are in load_kv_tile.
    tile = tl.program_id(0)
    seq = tl.program_id(1).to(tl.int64) + first_seq
    head = tl.program_id(2).to(tl.int64)
    kv_head = head // GROUP
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - q_len

    m = tile * BLOCK_M + tl.arange(0, BLOCK_M)     # query index within the chunk
    d = tl.arange(0, BLOCK_D)
    m_mask = m < q_len
    d_mask = d < HEAD_DIM
    q_rows = (q_start + m) * stride_qt + head * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    pos = prefix + m                                # each query's position in the sequence
    # Key ranges of the tile, in whole BLOCK_N tiles from `lo` (its first query's window start,
    # rounded down; keys before `first` are masked, their table entries may be -1):
    #   [lo, win_end): inside some rows' windows only: masked (window and causal);
    #   [win_end, full_end): before the tile's first query and inside every row's window: no mask;
    #   [full_end, kv_end): the diagonal, masked. A tile past the chunk's end has no keys.
    # Without a window (HAS_WINDOW false, a compile-time branch) the first range is empty.
    live = tile * BLOCK_M < q_len
    first_pos = prefix + tile * BLOCK_M
    kv_end = tl.where(live, tl.minimum(prefix + (tile + 1) * BLOCK_M, seq_len), 0)
    full_end = tl.where(live, first_pos // BLOCK_N * BLOCK_N, 0)
    m_i, l_i = sink_start(sinks_ptr, head + m * 0, m_mask, live, BLOCK_M, HAS_SINKS)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq * stride_bt
    if HAS_WINDOW:
        first = tl.maximum(first_pos - window + 1, 0)
        all_see = first_pos + BLOCK_M - window        # keys from here on are in every row's window
        w = pos - window                              # each row sees keys n > w
        lo = tl.where(live, first // BLOCK_N * BLOCK_N, 0)
        full_end = tl.maximum(full_end, lo)
        win_end = tl.minimum(tl.maximum((all_see + BLOCK_N - 1) // BLOCK_N * BLOCK_N, lo), full_end)
        for n0 in tl.range(lo, win_end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            n_mask = n >= first
            k, v = load_kv_tile(k_cache_ptr, v_cache_ptr, table, n, n_mask, d, d_mask, kv_head,
                                stride_c_block, stride_c_tok, stride_c_head, PAGE, True, UPCAST)
            s_mask = n_mask[None, :] & (n[None, :] > w[:, None])
            m_i, l_i, acc = attend_tile(q, k, v, s_mask, m_i, l_i, acc, qk_scale, softcap2, PRECISION, SOFTCAP,
                                        True)
    else:
        win_end = 0
    for n0 in tl.range(win_end, full_end, BLOCK_N, num_stages=NUM_STAGES):
        n = n0 + tl.arange(0, BLOCK_N)
        k, v = load_kv_tile(k_cache_ptr, v_cache_ptr, table, n, None, d, d_mask, kv_head,
                            stride_c_block, stride_c_tok, stride_c_head, PAGE, False, UPCAST)
        m_i, l_i, acc = attend_tile(q, k, v, True, m_i, l_i, acc, qk_scale, softcap2, PRECISION, SOFTCAP)
    for n0 in tl.range(full_end, kv_end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        if HAS_WINDOW:
            n_mask = (n >= first) & (n < kv_end)
            s_mask = n_mask[None, :] & (n[None, :] <= pos[:, None]) & (n[None, :] > w[:, None])
        else:
            n_mask = n < kv_end
            s_mask = n_mask[None, :] & (n[None, :] <= pos[:, None])
        k, v = load_kv_tile(k_cache_ptr, v_cache_ptr, table, n, n_mask, d, d_mask, kv_head,
                            stride_c_block, stride_c_tok, stride_c_head, PAGE, True, UPCAST)
        m_i, l_i, acc = attend_tile(q, k, v, s_mask, m_i, l_i, acc, qk_scale, softcap2, PRECISION, SOFTCAP,
                                    HAS_WINDOW)

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_rows = (q_start + m) * stride_ot + head * stride_oh
    tl.store(out_ptr + o_rows[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & d_mask[None, :])


def paged_prefill_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                            seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                            first_seq: int, num_seqs: int, max_query_len: int,
                            out: torch.Tensor, window: int | None = None, softcap: float = 0.0,
                            sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention for sequences first_seq .. first_seq + num_seqs - 1 of the batch.

    q, out: [T, Hq, D] for the whole flat batch (only these sequences' rows of `out`
    are written); kv_cache: [2, num_blocks, block_size, Hkv, D] already holding this
    step's K/V; block_tables, seq_lens, query_start_loc: the batch's metadata;
    max_query_len: the longest of these chunks (it sizes the launch); window, softcap, sinks:
    as paged_decode_attention's.
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = kv_cache.shape[3]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not divide into {num_kv_heads} KV heads")
    if num_seqs == 0 or max_query_len == 0:
        return out
    assert q.stride(-1) == 1 and out.stride(-1) == 1 and kv_cache.stride(-1) == 1
    check_device(_prefill_kernel, q.device)
    window = check_window(window)
    sinks = check_sinks(sinks, num_heads, q.device)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    t = tile_settings(head_dim)
    _prefill_kernel[(triton.cdiv(max_query_len, t["BLOCK_M"]), num_seqs, num_heads)](
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, sinks if sinks is not None else q, out,
        scale * LOG2E, softcap * LOG2E if softcap else 1.0, window, first_seq,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=next_pow2(head_dim),
        PAGE=kv_cache.shape[2], BLOCK_M=t["BLOCK_M"], BLOCK_N=t["BLOCK_N"],
        UPCAST=upcast(_prefill_kernel, q.dtype), PRECISION=dot_precision(q.dtype),
        NUM_STAGES=t["NUM_STAGES"], SOFTCAP=bool(softcap), HAS_SINKS=sinks is not None, HAS_WINDOW=window > 0,
        num_warps=t["NUM_WARPS"],
    )
    return out
