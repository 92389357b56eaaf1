"""The CPU attention backend: one compiled paged-attention kernel (pagedserve/kernels) per
layer for the whole batch, reading keys and values in place from their blocks. Prefill tokens
go through it too, each as a query over its own causal prefix (AttentionMetadata.per_token),
so there is no per-sequence loop and no gathered copy of the context. Falls back to the torch
reference where the kernel cannot run."""
from __future__ import annotations

import torch

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.attention.torch_backend import TorchAttention, write_kv
from pagedserve.kernels import cpu as cpu_kernels


class CpuAttention(TorchAttention):
    name = "cpu"
    head_major_cache = True      # the runner stores each block head by head (kernels read strides)

    def __init__(self) -> None:
        self.lib = cpu_kernels.load()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if not cpu_kernels.write_kv(kv_cache, k, v, meta.slot_mapping):
            write_kv(kv_cache, k, v, meta.slot_mapping)
        out = cpu_kernels.paged_decode_attention(q, kv_cache, *self.kernel_inputs(meta), scale)
        return out if out is not None else super().forward(q, k, v, kv_cache, meta, scale)

    @staticmethod
    def kernel_inputs(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """(block tables, context lengths) for the kernel, one row per query token."""
        return (meta.block_tables, meta.seq_lens) if meta.num_decodes == meta.num_seqs else meta.per_token
