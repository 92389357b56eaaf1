"""PagedAttention in plain torch: the CPU path and the reference for GPU kernels.

Each layer first writes the step's keys and values into their cache slots, then
every query attends over its own sequence's blocks, found through its block
table; the blocks need not be contiguous or in order.

With an 8-bit KV format (attention/kv_format.py) it is the reference of the CPU kernels: rows
are quantized in torch as they are written, and read back dequantized (a gathered float32
copy: this backend is for checking, not speed), with attention in float32.

A sliding window (AttentionMetadata.window: a hybrid model's KV group), logit soft-capping
(Gemma 2: scores = cap * tanh(scores / cap)) and attention sinks (gpt-oss: one learned logit
per query head, in the softmax's denominator only) take `_attend_general`: per sequence, only
the blocks from the window's first one on are read (the table's entries before it are -1).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.attention.kv_format import KVFormat, kv_format
from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.utils import cdiv


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """kv_cache: [2, num_blocks, block_size, Hkv, D], possibly a view of a head-major
    [2, num_blocks, Hkv, block_size, D] tensor; k, v: [T, Hkv, D]."""
    if kv_cache.is_contiguous():
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
        kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)
        return
    blocks, offsets = slot_mapping // kv_cache.shape[2], slot_mapping % kv_cache.shape[2]
    kv_cache[0][blocks, offsets] = k
    kv_cache[1][blocks, offsets] = v


def gather_kv(cache: torch.Tensor, block_ids: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of a sequence, read block by block: [length, Hkv, D]."""
    return cache[block_ids].flatten(0, 1)[:length]


class TorchAttention:
    name = "torch"
    head_major_cache = False

    def __init__(self, kv_cache_dtype: str = "auto") -> None:
        self.kv_format: KVFormat = kv_format(kv_cache_dtype)

    def prepare(self, meta: AttentionMetadata) -> None:
        pass

    def write_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        if self.kv_format.quantized:
            k, v = self.kv_format.quantize(k), self.kv_format.quantize(v)
        write_kv(kv_cache, k, v, slot_mapping)

    def _values(self, rows: torch.Tensor, head_dim: int) -> torch.Tensor:
        """Cached rows as attention reads them: 8-bit rows dequantized to float32."""
        return self.kv_format.dequantize(rows, head_dim) if self.kv_format.quantized else rows

    @staticmethod
    def copy_blocks(kv_cache: torch.Tensor, copies: list[tuple[int, int]]) -> None:
        src, dst = zip(*copies)
        kv_cache[:, :, list(dst)] = kv_cache[:, :, list(src)]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, softcap: float = 0.0,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D] for this step's tokens. Returns [T, Hq, D].
        softcap: cap the scores at +-softcap (tanh; 0: none); sinks [Hq]: a logit per head that
        joins each softmax's denominator (None: none)."""
        self.write_kv(kv_cache, k, v, meta.slot_mapping)
        return self._reference(q, k, v, kv_cache, meta, scale, softcap, sinks)

    def _reference(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                   meta: AttentionMetadata, scale: float, softcap: float = 0.0,
                   sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Attention over the cache the step's K/V were already written into."""
        if meta.window is not None or softcap or sinks is not None:
            return self._attend_general(q, kv_cache, meta, scale, softcap, sinks)
        if self.kv_format.quantized:       # float32 over the dequantized cache (never the step's own k, v)
            return self._attend(q.float(), k, v, kv_cache, meta, scale).to(q.dtype)
        return self._attend(q, k, v, kv_cache, meta, scale)

    def _attend_general(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                        softcap: float, sinks: torch.Tensor | None) -> torch.Tensor:
        """Each sequence on its own, in float32: its queries over the cached positions they may
        read, from the window's first block on (nothing before it is touched)."""
        B, head_dim, window = kv_cache.shape[2], q.shape[-1], meta.window
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        qsl, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        for i in range(meta.num_seqs):
            start, end, seq_len = qsl[i], qsl[i + 1], lens[i]
            first_query = seq_len - (end - start)
            first = 0 if window is None else max(0, first_query - window + 1) // B
            table = meta.block_tables[i, first:cdiv(seq_len, B)]
            num_keys = seq_len - first * B
            keys = self._values(kv_cache[0][table].flatten(0, 1)[:num_keys], head_dim)
            values = self._values(kv_cache[1][table].flatten(0, 1)[:num_keys], head_dim)
            key_pos = torch.arange(first * B, seq_len, device=q.device)
            query_pos = torch.arange(first_query, seq_len, device=q.device)[:, None]
            allowed = key_pos <= query_pos
            if window is not None:
                allowed &= key_pos > query_pos - window
            out[start:end] = attention_math(q[start:end], keys, values, scale, allowed, softcap, sinks)
        return out

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        nd = meta.num_decodes
        head_dim = q.shape[-1]
        if nd == meta.num_seqs:
            return self._decode(q, kv_cache, meta, scale)     # all decodes: no extra copy
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if nd:
            out[:nd] = self._decode(q[:nd], kv_cache, meta, scale)
        qsl, lens = meta.query_start_loc_cpu, meta.seq_lens_cpu
        for i in range(nd, meta.num_seqs):
            start, end, seq_len = qsl[i], qsl[i + 1], lens[i]
            if end - start == seq_len and not self.kv_format.quantized:
                # Nothing cached before this chunk: attend over the step's own keys.
                keys, values = k[start:end], v[start:end]
            else:
                n_blocks = cdiv(seq_len, kv_cache.shape[2])
                table = meta.block_tables[i, :n_blocks]
                keys = self._values(gather_kv(kv_cache[0], table, seq_len), head_dim)
                values = self._values(gather_kv(kv_cache[1], table, seq_len), head_dim)
            out[start:end] = _causal_attention(q[start:end], keys, values, scale)
        return out

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        """One query per sequence, batched: gather each sequence's blocks (padded to the
        longest) and mask the padding."""
        nd = meta.num_decodes
        block_size = kv_cache.shape[2]
        n_blocks = cdiv(meta.max_seq_len, block_size)
        tables = meta.block_tables[:nd, :n_blocks]
        keys = self._values(kv_cache[0][tables].flatten(1, 2), q.shape[-1])       # [N, L, Hkv, D]
        values = self._values(kv_cache[1][tables].flatten(1, 2), q.shape[-1])
        length = keys.shape[1]
        pad = torch.arange(length, device=q.device) >= meta.seq_lens[:nd, None]        # [N, L]
        mask = torch.zeros(nd, 1, 1, length, dtype=q.dtype, device=q.device).masked_fill_(
            pad[:, None, None, :], float("-inf"))
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2),
            attn_mask=mask, scale=scale, enable_gqa=True)
        return out.squeeze(2)


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [Lq, Hq, D] are the last Lq of the Lk positions in k, v: [Lk, Hkv, D]."""
    lq, lk = q.shape[0], k.shape[0]
    qt, kt, vt = q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
    if lq == lk:
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=True)
    else:
        allowed = torch.arange(lk, device=q.device)[None, :] <= torch.arange(lk - lq, lk, device=q.device)[:, None]
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=allowed, scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)


def attention_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, allowed: torch.Tensor,
                   softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q: [Lq, Hq, D] over k, v: [Lk, Hkv, D] (grouped heads), allowed: [Lq, Lk]; in float32, the
    formula term for term: scores, soft-capped (cap * tanh(s / cap)), masked, softmax with the
    head's sink logit in the denominator, times v."""
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), kf) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(-1, 1, 1).expand(-1, scores.shape[1], 1)
        probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, vf).to(q.dtype)
