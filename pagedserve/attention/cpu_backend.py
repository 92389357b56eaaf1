"""The CPU attention backend: decodes run the compiled paged-attention kernel
(pagedserve/kernels), which reads keys and values in place from their blocks; prefill
chunks use torch's SDPA. Falls back to the torch reference where the kernel cannot run."""
from __future__ import annotations

import torch

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.attention.torch_backend import TorchAttention
from pagedserve.kernels import cpu as cpu_kernels


class CpuAttention(TorchAttention):
    name = "cpu"

    def __init__(self) -> None:
        self.lib = cpu_kernels.load()

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        out = cpu_kernels.paged_decode_attention(q, kv_cache, meta.block_tables, meta.seq_lens, scale)
        return out if out is not None else super()._decode(q, kv_cache, meta, scale)
