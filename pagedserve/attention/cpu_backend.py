"""The CPU attention backend: one compiled paged-attention call (pagedserve/kernels) per layer
for the whole batch, reading keys and values in place from their blocks: decode tokens through
the decode kernel, prefill chunks (AVX2 and up) through a tiled kernel that meets a chunk's
query tokens (up to 64 rows of them, 16 tokens with bf16 dot products) with 32 keys at a time; elsewhere each prefill token goes through the decode kernel as a
query over its own causal prefix (AttentionMetadata.per_token). No gathered copy of the context. Falls
back to the torch reference where the kernel cannot run. With an 8-bit KV format the write kernel
quantizes each (token, head) row into its slot and every attention kernel reads the codes,
converting them in registers (attention/kv_format.py). A layer's sliding window
(AttentionMetadata.window), logit soft-capping and attention sinks run in the same kernels."""
from __future__ import annotations

import torch

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.attention.torch_backend import TorchAttention
from pagedserve.kernels import cpu as cpu_kernels


class CpuAttention(TorchAttention):
    name = "cpu"
    head_major_cache = True      # the runner stores each block head by head (kernels read strides)

    def __init__(self, kv_cache_dtype: str = "auto") -> None:
        super().__init__(kv_cache_dtype)
        self.lib = cpu_kernels.load()
        # The step's query rows per KV group's metadata (a hybrid model has one per group).
        self._rows: dict[int, tuple[AttentionMetadata, cpu_kernels.AttentionRows]] = {}

    def prepare(self, meta: AttentionMetadata) -> None:
        self._rows.clear()
        for m in meta.groups or [meta]:
            self.kernel_rows(m)

    def write_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        if not cpu_kernels.write_kv(kv_cache, k, v, slot_mapping, self.kv_format.code):
            super().write_kv(kv_cache, k, v, slot_mapping)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, softcap: float = 0.0,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        self.write_kv(kv_cache, k, v, meta.slot_mapping)
        out = cpu_kernels.paged_attention(q, kv_cache, self.kernel_rows(meta), scale, self.kv_format.code,
                                          cpu_kernels.ScoreMods.of(softcap, sinks))
        return out if out is not None else self._reference(q, k, v, kv_cache, meta, scale, softcap, sinks)

    def kernel_rows(self, meta: AttentionMetadata) -> cpu_kernels.AttentionRows:
        """The step's query rows as the kernel reads them; built once per step (`prepare`), used by
        every layer."""
        cached = self._rows.get(id(meta))
        if cached is None or cached[0] is not meta:
            prefills = meta.num_decodes < meta.num_seqs
            cached = self._rows[id(meta)] = (meta, cpu_kernels.AttentionRows.of(
                meta.block_tables, meta.seq_lens, meta.query_start_loc, meta.num_decodes,
                meta.per_token if prefills else None, meta.window, meta.num_verify))
        return cached[1]
