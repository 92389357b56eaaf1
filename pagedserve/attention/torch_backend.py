"""PagedAttention in plain torch: the CPU path and the reference for GPU kernels.

Each layer first writes the step's keys and values into their cache slots, then
every query attends over its own sequence's blocks, found through its block
table; the blocks need not be contiguous or in order.

With an 8-bit KV format (attention/kv_format.py) it is the reference of the CPU kernels: rows
are quantized in torch as they are written, and read back dequantized (a gathered float32
copy: this backend is for checking, not speed), with attention in float32.
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
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D] for this step's tokens. Returns [T, Hq, D]."""
        self.write_kv(kv_cache, k, v, meta.slot_mapping)
        return self._reference(q, k, v, kv_cache, meta, scale)

    def _reference(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                   meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """Attention over the cache the step's K/V were already written into."""
        if self.kv_format.quantized:       # float32 over the dequantized cache (never the step's own k, v)
            return self._attend(q.float(), k, v, kv_cache, meta, scale).to(q.dtype)
        return self._attend(q, k, v, kv_cache, meta, scale)

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
