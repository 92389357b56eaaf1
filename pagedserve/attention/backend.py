"""What an attention backend gives the model and the worker.

A backend owns everything device-specific about paged attention: how the KV cache is
laid out in a block (`head_major_cache`), how the step's new keys and values are
written into their slots, attention over the cached blocks, copying whole blocks
(copy-on-write), and anything it derives once per step from the batch (`prepare`).
Backends: `cpu` (compiled kernels), `torch` (the reference), `triton` (GPU);
attention/selector.py picks one.
"""
from __future__ import annotations

from typing import Protocol

import torch

from pagedserve.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    name: str
    # The cache is [layers, K/V, blocks, block_size, kv_heads, head_dim] either way; head-major
    # backends store it as a view of [..., kv_heads, block_size, head_dim] (one head's keys of a
    # block contiguous) and read strides.
    head_major_cache: bool

    def prepare(self, meta: AttentionMetadata) -> None:
        """Once per step, before the first layer: derive what every layer reuses."""

    def write_kv(self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """Copy the step's k, v [T, Hkv, D] into their slots of one layer's cache."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, softcap: float = 0.0,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Write k, v, then attend: q [T, Hq, D] over each sequence's cached tokens (within
        meta.window, a KV group's sliding window; scores soft-capped at softcap; sinks [Hq]: a
        learned logit per head in the softmax's denominator). Returns [T, Hq, D]."""

    def copy_blocks(self, kv_cache: torch.Tensor, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks (all layers, K and V) of the full cache, (src, dst) pairs."""
