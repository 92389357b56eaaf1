"""The KV cache as the scheduler sees it: a narrow, typed interface.

Both the paged manager (kv_cache_manager.py) and the contiguous baselines
(contiguous.py) implement `KVCache`; the scheduler and the invariant checker use
nothing else. Everything is in block ids and counts: no block objects cross this
line. Swap space is a collaborator of its own (`swap.SwapSpace`), which only the
paged manager has.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from pagedserve.kv.fit import RequestFit
    from pagedserve.kv.memory_usage import MemoryUsage
    from pagedserve.kv.snapshot import KVSnapshot
    from pagedserve.kv.swap import SwapSpace

BlockCopy = tuple[int, int]                      # (src, dst) block ids
# One sequence's slots for a step: (seq_id, its token ids, computed tokens, new tokens).
SlotRequest = tuple[int, list[int], int, int]


@dataclass(frozen=True)
class SeqState:
    """What the invariant checker tells the KV cache about a live sequence."""
    token_ids: list[int]
    num_computed_tokens: int
    cache_salt: str | None = None
    num_draft_slots: int = 0   # slots for speculative drafts past token_ids, in the step about to run
    num_new_tokens: int = 0    # tokens the step about to run computes for it (0: not scheduled, or between steps)


@dataclass(frozen=True)
class StepWrite:
    """A sequence's part of the step about to run, as handed to the worker."""
    seq_id: int
    start: int                 # first position written
    num_new_tokens: int
    block_ids: list[int]       # the block table the worker receives (group 0's)
    group_block_ids: list[list[int]] = field(default_factory=list)   # groups 1..'s (kv/groups.py)


@dataclass
class KVCacheStats:
    """A snapshot of the cache's counters. Fields that do not apply to an allocator are None
    (and left out of `as_dict`)."""
    num_blocks: int
    block_size: int
    num_free_blocks: int
    num_used_blocks: int
    num_cached_blocks: int
    prefix_cache_queries: int            # prompt tokens looked up
    prefix_cache_hits: int               # of those, tokens found
    num_logical_blocks: int              # block-table entries (a shared block counts once per table)
    num_evicted_blocks: int | None = None
    num_host_blocks: int | None = None
    num_free_host_blocks: int | None = None
    num_swapped_out_blocks: int | None = None
    num_swapped_in_blocks: int | None = None
    kv_allocator: str | None = None      # the contiguous baselines: policy and holes
    num_holes: int | None = None
    largest_hole_blocks: int | None = None
    # The tier below the pool (kv/tier.py; None: no tier): blocks it holds, prompt tokens looked
    # up there and found (vLLM's external prefix cache), blocks and bytes moved, failed reads.
    kv_offload_blocks: int | None = None
    kv_offload_queries: int | None = None
    kv_offload_hits: int | None = None
    kv_offload_blocks_saved: int | None = None
    kv_offload_blocks_loaded: int | None = None
    kv_offload_load_failures: int | None = None
    kv_offload_bytes_written: int | None = None
    kv_offload_bytes_read: int | None = None
    kv_offload_host_blocks: int | None = None      # the host-memory tier (kv_offload_cpu_gb): blocks held,
    kv_offload_host_loads: int | None = None       # loads it served
    kv_groups: list[str] | None = None   # a hybrid model's KV groups (kv/groups.py): "full", "sliding_window=W"
    num_blocks_per_group: list[int] | None = None   # distinct device blocks each group's tables hold

    @property
    def usage(self) -> float:
        return self.num_used_blocks / max(1, self.num_blocks)

    @property
    def sharing_saving(self) -> float:
        """Sharing as the paper measures it: blocks saved / blocks needed without sharing."""
        logical = self.num_logical_blocks
        return (logical - self.num_used_blocks) / logical if logical else 0.0

    def as_dict(self) -> dict:
        out = {k: v for k, v in asdict(self).items() if v is not None}
        out.update(usage=self.usage, sharing_saving=self.sharing_saving)
        return out


class PoolCapacity:
    """Capacity counters of whatever holds blocks in `self.pool` (a BlockPool or a region
    allocator), for the classes built on one."""
    pool: Any

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_blocks - self.pool.num_free_blocks


class KVCache(Protocol):
    block_size: int
    num_groups: int                   # KV groups (kv/groups.py): one table per sequence and group
    swap: SwapSpace | None            # swap space (preemption_mode="swap"); None where there is none
    fit: RequestFit                   # could a request ever fit, even alone (kv/fit.py: sizes only, a value)

    @property
    def num_blocks(self) -> int: ...

    @property
    def num_free_blocks(self) -> int: ...

    @property
    def num_used_blocks(self) -> int: ...

    @property
    def num_logical_blocks(self) -> int: ...

    def admit(self, seq_id: int, token_ids: list[int], max_len: int, cache_salt: str | None,
              use_prefix_cache: bool, invariant_only: bool = False, hit: Any = None) -> int:
        """Start a sequence's block table: take the cached blocks of its longest cached prefix
        of `token_ids` (invariant_only: of blocks that batch-invariant steps computed); returns
        the number of tokens they hold (computed already). `hit`: cached_prefix's lookup for the
        same arguments, with nothing changed since (no second lookup)."""

    def cached_prefix_len(self, token_ids: list[int], cache_salt: str | None, invariant_only: bool = False) -> int:
        """The tokens `admit` would take from the prefix cache now (changes nothing; invariant_only
        as `admit`'s)."""

    def cached_prefix(self, token_ids: list[int], cache_salt: str | None,
                      invariant_only: bool = False) -> tuple[int, Any]:
        """cached_prefix_len, and the lookup itself (opaque) for `admit` in the same step."""

    def allocate_slots(self, requests: list[SlotRequest]) -> list[BlockCopy] | None:
        """Room for every request's new tokens, all or nothing: the copy-on-write copies the
        worker must do before the step, or None (nothing changed) when blocks are short."""

    def mark_batch_dependent(self, writes: list[tuple[int, int]]) -> None:
        """The step about to run is not batch-invariant: each (seq_id, start) computes its
        sequence's tokens from start on with arithmetic that depends on the batch."""

    def fork(self, parent_id: int, child_id: int) -> None: ...

    def free(self, seq_id: int, token_ids: Seq[int] = (), num_computed: int = 0) -> None:
        """Drop the sequence's blocks; its tokens and computed count let the paged cache keep its
        last, partly computed block cached (enable_partial_block_caching)."""

    def trim(self, seq_id: int, num_tokens: int) -> None:
        """Release the sequence's blocks past its first num_tokens slots (speculative decoding's
        rejected drafts; only the paged cache has them)."""

    def block_ids(self, seq_id: int) -> list[int]:
        """Group 0's table as the worker receives it (-1: a hole behind a sliding window)."""

    def group_block_ids(self, seq_id: int) -> list[list[int]]:
        """The tables of groups 1.. (empty with one group)."""

    def num_blocks_to_hold(self, seq_id: int, num_tokens: int) -> int:
        """Blocks the sequence must still take to hold its first num_tokens tokens (admission control)."""

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None: ...

    def stats(self) -> KVCacheStats: ...

    def snapshot(self) -> KVSnapshot:
        """A read-only copy of the blocks and tables (kv/snapshot.py), for the dashboard."""

    def memory_usage(self, seqs: list[tuple[int, int, int]], waiting_max_len: int | None = None) -> MemoryUsage: ...

    def check_invariants(self, live: dict[int, SeqState] | None = None, swapped: set[int] = frozenset()) -> None:
        """Raise AssertionError if the cache is inconsistent; with `live` (the live sequences of
        running requests) and `swapped` (those of swapped-out ones), also that only they hold
        blocks, with a slot for every computed token."""

    def check_step(self, writes: list[StepWrite], block_copies: list[BlockCopy], swap_out: list[BlockCopy],
                   swap_in: list[BlockCopy]) -> None:
        """Raise AssertionError if the step about to run writes a block another table holds or
        hands the worker a stale block table."""
