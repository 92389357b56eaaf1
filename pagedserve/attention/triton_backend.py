"""PagedAttention with Triton kernels: the GPU path (on CPU tensors it runs under
Triton's interpreter, which is how the tests check it against the torch backend)."""
from __future__ import annotations

import torch

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.attention.triton_cache_ops import copy_blocks, write_kv
from pagedserve.attention.triton_decode import _decode_kernel, paged_decode_attention
from pagedserve.attention.triton_utils import check_device
from pagedserve.attention.triton_prefill import paged_prefill_attention


class TritonAttention:
    name = "triton"
    head_major_cache = False

    def __init__(self, device: torch.device | str = "cuda") -> None:
        check_device(_decode_kernel, torch.device(device))   # fail now, not in the first step

    def prepare(self, meta: AttentionMetadata) -> None:
        pass

    def write_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        write_kv(kv_cache, k, v, slot_mapping)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, softcap: float = 0.0,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D] for this step's tokens; kv_cache: one layer's
        [2, num_blocks, block_size, Hkv, D]. Returns [T, Hq, D]. meta.window (a KV group's
        sliding window: blocks before it are never read), softcap and sinks: in the kernels."""
        self.write_kv(kv_cache, k, v, meta.slot_mapping)
        return self._attend(q, kv_cache, meta, scale, softcap, sinks)

    def _attend(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Attention over the cache the step's K/V were already written into."""
        extra = dict(window=meta.window, softcap=softcap, sinks=sinks)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            # Decodes come first, one token each: token i is sequence i's query.
            paged_decode_attention(q[:nd], kv_cache, meta.block_tables, meta.seq_lens, scale,
                                   meta.max_seq_len, out=out[:nd], **extra)
        if nd < meta.num_seqs:
            qsl = meta.query_start_loc_cpu
            max_query_len = max(qsl[i + 1] - qsl[i] for i in range(nd, meta.num_seqs))
            paged_prefill_attention(q, kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale,
                                    first_seq=nd, num_seqs=meta.num_seqs - nd, max_query_len=max_query_len,
                                    out=out, **extra)
        return out

    @staticmethod
    def copy_blocks(kv_cache: torch.Tensor, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write before a step: duplicate blocks (all layers, K and V) in place."""
        copy_blocks(kv_cache, kv_cache, copies)
