"""Pick the KV cache manager: paged (the engine's own) or a contiguous-reservation baseline."""
from __future__ import annotations

from collections.abc import Sequence

from pagedserve.config import CONTIGUOUS_POLICIES, KV_ALLOCATORS
from pagedserve.kv.contiguous import ContiguousKVCacheManager
from pagedserve.kv.events import KVEventSink
from pagedserve.kv.interface import KVCache
from pagedserve.kv.kv_cache_manager import KVCacheManager
from pagedserve.kv.tier import TierIndex


def make_kv_cache_manager(kind: str, num_blocks: int, block_size: int, enable_caching: bool,
                          max_model_len: int | None, num_host_blocks: int = 0,
                          kv_events: KVEventSink | None = None, kv_cache_dtype: str = "auto",
                          tier: TierIndex | None = None, kv_windows: Sequence[int | None] = (None,),
                          max_step_tokens: int | None = None, partial_blocks: bool = False) -> KVCache:
    """num_host_blocks: swap space (preemption_mode="swap"), which only the paged manager has;
    kv_events: told of prefix-cache changes (the baselines cache nothing, so never hear of any);
    kv_cache_dtype: part of the prefix-cache keys (an 8-bit cache's blocks never mix with 16-bit ones);
    tier: the keys of the tier below the pool (kv/tier.py), which only the paged manager has;
    kv_windows: each KV group's sliding window (kv/groups.py; None: full attention); max_step_tokens:
    the token budget of a step (a window group's blocks during a prefill chunk); partial_blocks: a
    freed sequence's last, partly computed block stays in the prefix cache (the paged manager's)."""
    if kind == "paged":
        return KVCacheManager(num_blocks, block_size, enable_caching, num_host_blocks, kv_events, kv_cache_dtype,
                              tier, kv_windows, max_step_tokens, partial_blocks)
    if tier is not None:
        raise ValueError(f"kv_offload_path needs kv_allocator='paged', not {kind!r}")
    if len(kv_windows) > 1:
        raise ValueError(f"kv_allocator={kind!r} reserves one region per sequence for every layer: a model with "
                         f"several KV groups (sliding-window layers) needs kv_allocator='paged'")
    if num_host_blocks:
        raise ValueError(f"preemption_mode='swap' needs kv_allocator='paged', not {kind!r}")
    if kind in CONTIGUOUS_POLICIES:
        return ContiguousKVCacheManager(num_blocks, block_size, kind, max_model_len)
    raise ValueError(f"kv_allocator must be one of {', '.join(KV_ALLOCATORS)}; got {kind!r}")
