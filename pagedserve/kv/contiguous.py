"""Baselines without paging: one contiguous region of KV slots per sequence, reserved at admission.

This is how serving systems managed the KV cache before PagedAttention (the
vLLM paper's "Orca" baselines): when a request is admitted it gets one
contiguous region big enough for the longest it may grow, and keeps it until
it finishes. Three policies size the region:

- `max`: max_model_len slots, whatever the request (Orca-Max);
- `pow2`: the next power of two of prompt + output length, at most
  max_model_len (Orca-Pow2);
- `oracle`: exactly prompt + output length (Orca-Oracle; an upper bound, since a
  real system does not know the output length in advance).

`pow2` and `oracle` take the output length to be the request's max_tokens, which
is its true length when it ignores EOS and has no stop condition (as in the
benchmark traces) and an upper bound otherwise.

Regions come from one space of blocks through a first-fit allocator, so holes
appear as requests come and go, and a request can wait although enough slots are
free in total: external fragmentation, measured in `memory_usage`. Regions are
whole blocks so the worker addresses them like paged sequences: a region is a
block table of consecutive block ids, and attention reads one contiguous range
per sequence. With block_size=1 the reservation is exact to the slot; with larger
blocks the rounding shows up as internal fragmentation. Nothing is shared: no
fork, no prefix caching, and a running sequence never needs more memory, so it is
never preempted.

The same `KVCache` interface (kv/interface.py) as `KVCacheManager`, so the same
scheduler, model and attention run on top.
"""
from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pagedserve.config import CONTIGUOUS_POLICIES
from pagedserve.kv.block_pool import NoFreeBlocksError
from pagedserve.kv.fit import ContiguousFit
from pagedserve.kv.interface import BlockCopy, KVCacheStats, PoolCapacity, SeqState, SlotRequest, StepWrite
from pagedserve.kv.kv_cache_manager import PrefixCacheStats
from pagedserve.utils import cdiv
from pagedserve.kv.memory_usage import MemoryUsage
from pagedserve.kv.snapshot import KVSnapshot, PoolSnapshot


class RegionAllocator:
    """First-fit allocation of contiguous block ranges out of `num_blocks` blocks.

    Free space is a sorted list of holes [start, length]; freeing a region merges
    it with the holes on either side, so two holes are never adjacent.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.holes: list[list[int]] = [[0, num_blocks]] if num_blocks else []
        self.num_free_blocks = num_blocks

    @property
    def largest_hole(self) -> int:
        return max((length for _, length in self.holes), default=0)

    def find(self, n: int, holes: list[list[int]] | None = None) -> int | None:
        """Index of the first hole that holds n blocks (in `holes`, default our own)."""
        for i, (_, length) in enumerate(self.holes if holes is None else holes):
            if length >= n:
                return i
        return None

    def allocate(self, n: int) -> int:
        """Take n contiguous blocks from the first hole that holds them; returns the start."""
        i = self.find(n)
        if i is None:
            raise NoFreeBlocksError(f"no hole of {n} contiguous blocks ({self.num_free_blocks} free, "
                                    f"largest hole {self.largest_hole})")
        hole = self.holes[i]
        start = hole[0]
        hole[0] += n
        hole[1] -= n
        if hole[1] == 0:
            del self.holes[i]
        self.num_free_blocks -= n
        return start

    def free(self, start: int, n: int) -> None:
        i = bisect.bisect_left(self.holes, [start, 0])
        prev = self.holes[i - 1] if i > 0 else None
        nxt = self.holes[i] if i < len(self.holes) else None
        assert (prev is None or prev[0] + prev[1] <= start) and (nxt is None or start + n <= nxt[0]), (
            f"freeing blocks [{start}, {start + n}) that overlap a hole")
        if prev is not None and prev[0] + prev[1] == start:
            prev[1] += n
            if nxt is not None and start + n == nxt[0]:
                prev[1] += nxt[1]
                del self.holes[i]
        elif nxt is not None and start + n == nxt[0]:
            nxt[0] = start
            nxt[1] += n
        else:
            self.holes.insert(i, [start, n])
        self.num_free_blocks += n

    def check(self) -> None:
        end = 0
        for start, length in self.holes:
            assert length > 0, f"empty hole at {start}"
            assert start > end or (start == 0 and end == 0), f"hole at {start} touches or overlaps the one before"
            end = start + length
        assert end <= self.num_blocks
        assert sum(length for _, length in self.holes) == self.num_free_blocks


@dataclass(frozen=True)
class Region:
    start: int         # first block
    num_blocks: int


class ContiguousKVCacheManager(PoolCapacity):
    """Reserves one contiguous region per sequence when its first tokens are allocated."""

    enable_caching = False
    swap = None          # no swap space: a running sequence never needs more memory
    num_groups = 1       # every layer in one region per sequence (a window's tokens are reserved too)

    def __init__(self, num_blocks: int, block_size: int, policy: str, max_model_len: int | None) -> None:
        if policy not in CONTIGUOUS_POLICIES:
            raise ValueError(f"contiguous policy must be one of {', '.join(CONTIGUOUS_POLICIES)}; got {policy!r}")
        if policy == "max" and max_model_len is None:
            raise ValueError("the 'max' allocator reserves max_model_len slots per request: give max_model_len")
        self.policy = policy
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.pool = RegionAllocator(num_blocks)
        self.fit = ContiguousFit(num_blocks, block_size, policy, max_model_len)   # could a request ever fit
        self.tables: dict[int, Region] = {}
        self.max_lens: dict[int, int] = {}    # seq_id -> prompt + max_tokens, given at admission
        self.prefix_stats = PrefixCacheStats()

    # ---- sizing (kv/fit.py) -------------------------------------------------------------------
    def reservation_slots(self, max_len: int) -> int:
        return self.fit.reservation_slots(max_len)

    def reservation_blocks(self, max_len: int) -> int:
        return self.fit.reservation_blocks(max_len)

    def set_max_len(self, seq_id: int, max_len: int) -> None:
        """At admission: the most tokens the sequence can reach, which sizes its region."""
        self.max_lens[seq_id] = max_len

    # ---- queries (num_blocks, num_free_blocks, num_used_blocks: PoolCapacity) ----------------
    @property
    def num_logical_blocks(self) -> int:
        return self.num_used_blocks    # nothing is shared

    def block_ids(self, seq_id: int) -> list[int]:
        region = self.tables.get(seq_id)
        return [] if region is None else list(range(region.start, region.start + region.num_blocks))

    def group_block_ids(self, seq_id: int) -> list[list[int]]:
        return []

    def num_held_blocks(self, seq_id: int) -> int:
        region = self.tables.get(seq_id)
        return 0 if region is None else region.num_blocks

    def num_blocks_to_hold(self, seq_id: int, num_tokens: int) -> int:
        return max(0, cdiv(num_tokens, self.block_size) - self.num_held_blocks(seq_id))

    def admit(self, seq_id: int, token_ids: list[int], max_len: int, cache_salt: str | None = None,
              use_prefix_cache: bool = True, invariant_only: bool = False, hit: Any = None) -> int:
        """Note the most tokens the sequence can reach (its region's size); no prefix caching
        without shared blocks, so nothing is cached."""
        self.set_max_len(seq_id, max_len)
        return 0

    def cached_prefix_len(self, token_ids: list[int], cache_salt: str | None = None,
                          invariant_only: bool = False) -> int:
        return 0

    def cached_prefix(self, token_ids: list[int], cache_salt: str | None = None,
                      invariant_only: bool = False) -> tuple[int, Any]:
        return 0, None

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_stats.queries += num_tokens
        self.prefix_stats.hits += num_hit_tokens

    def num_blocks_needed(self, seq_id: int, num_computed: int, num_new: int, prefix_blocks=()) -> int:
        if seq_id in self.tables or num_computed + num_new == 0:
            return 0
        return self.reservation_blocks(self.max_lens[seq_id])

    def can_allocate(self, requests: list[tuple[int, int, int]]) -> bool:
        """Whether every (seq_id, num_computed, num_new) can get its slots at once: each
        sequence without a region needs a hole, taken first fit in order."""
        holes = [list(h) for h in self.pool.holes]
        for seq_id, num_computed, num_new in requests:
            need = self.num_blocks_needed(seq_id, num_computed, num_new)
            if need == 0:
                continue
            i = self.pool.find(need, holes)
            if i is None:
                return False
            holes[i][1] -= need
        return True

    # ---- changes -----------------------------------------------------------------------------
    def allocate_slots(self, requests: list[SlotRequest]) -> list[BlockCopy] | None:
        if not self.can_allocate([(seq_id, computed, new) for seq_id, _, computed, new in requests]):
            return None
        for seq_id, token_ids, computed, new in requests:
            self.allocate(seq_id, token_ids, computed, new)
        return []

    def allocate(self, seq_id: int, token_ids: list[int], num_computed: int, num_new: int,
                 prefix_blocks=(), cache_salt: str | None = None) -> list[tuple[int, int]]:
        """Reserve the sequence's whole region with its first tokens. Never copies."""
        assert not prefix_blocks, "contiguous allocators take no prefix-cache hits"
        region = self.tables.get(seq_id)
        if region is None and num_computed + num_new > 0:
            n = self.reservation_blocks(self.max_lens[seq_id])
            region = self.tables[seq_id] = Region(self.pool.allocate(n), n)
        if region is not None:
            assert num_computed + num_new <= region.num_blocks * self.block_size, (
                f"sequence {seq_id} outgrew its reservation of {region.num_blocks} blocks")
        return []

    def fork(self, parent_id: int, child_id: int) -> None:
        raise ValueError(f"kv_allocator={self.policy!r} cannot share blocks between sequences")

    def mark_batch_dependent(self, writes: list[tuple[int, int]]) -> None:
        """Nothing is cached, so nothing to mark."""

    def trim(self, seq_id: int, num_tokens: int) -> None:
        """A reservation holds its slots to the end: nothing to release (speculative decoding,
        which trims, runs on the paged cache only)."""

    def free(self, seq_id: int, token_ids: Sequence[int] = (), num_computed: int = 0) -> None:
        region = self.tables.pop(seq_id, None)
        self.max_lens.pop(seq_id, None)
        if region is not None:
            self.pool.free(region.start, region.num_blocks)

    # ---- accounting --------------------------------------------------------------------------
    def memory_usage(self, seqs: list[tuple[int, int, int]], waiting_max_len: int | None = None) -> MemoryUsage:
        """Slots by category (see memory_usage.py) for the sequences (seq_id, computed tokens,
        final length) and, if a request waits, the most tokens the first one can reach."""
        usage = MemoryUsage()
        for seq_id, written, final_len in seqs:
            region = self.tables.get(seq_id)
            if region is not None:
                usage.add_held(0, region.num_blocks * self.block_size, written, final_len)
        free = self.pool.num_free_blocks * self.block_size
        if waiting_max_len is not None:
            need = self.reservation_blocks(waiting_max_len)
            if need <= self.pool.num_free_blocks and self.pool.largest_hole < need:
                usage.external_fragmentation, free = free, 0
        usage.free = free
        return usage

    def snapshot(self) -> KVSnapshot:
        """Each region's blocks held once by its sequence; nothing cached, no swap space."""
        ref_cnts = [0] * self.pool.num_blocks
        tables = {}
        for seq_id, region in self.tables.items():
            ref_cnts[region.start:region.start + region.num_blocks] = [1] * region.num_blocks
            tables[seq_id] = list(range(region.start, region.start + region.num_blocks))
        return KVSnapshot(self.block_size, PoolSnapshot(ref_cnts, [None] * len(ref_cnts), tables),
                          kv_allocator=self.policy)

    def stats(self) -> KVCacheStats:
        pool = self.pool
        return KVCacheStats(
            num_blocks=pool.num_blocks, block_size=self.block_size, num_free_blocks=pool.num_free_blocks,
            num_used_blocks=self.num_used_blocks, num_cached_blocks=0,
            prefix_cache_queries=self.prefix_stats.queries, prefix_cache_hits=self.prefix_stats.hits,
            num_logical_blocks=self.num_used_blocks, kv_allocator=self.policy, num_holes=len(pool.holes),
            largest_hole_blocks=pool.largest_hole)

    def check_invariants(self, live: dict[int, SeqState] | None = None, swapped: set[int] = frozenset()) -> None:
        """Regions and holes tile the block space exactly, with no overlap; with `live`, only
        live sequences hold a region, big enough for their computed tokens."""
        self.pool.check()
        spans = sorted([(r.start, r.num_blocks) for r in self.tables.values()] +
                       [(s, n) for s, n in self.pool.holes])
        pos = 0
        for start, n in spans:
            assert start == pos, f"blocks [{pos}, {start}) are neither free nor in a region" if start > pos \
                else f"block {start} is in two places"
            pos = start + n
        assert pos == self.pool.num_blocks, f"blocks [{pos}, {self.pool.num_blocks}) are unaccounted for"
        assert set(self.max_lens) >= set(self.tables)
        if live is not None:
            stray = set(self.tables) - set(live)
            assert not stray, f"sequences {sorted(stray)} hold blocks but are not live in a running request"
            for seq_id, seq in live.items():
                assert seq.num_computed_tokens <= self.num_held_blocks(seq_id) * self.block_size, (
                    f"sequence {seq_id}: {seq.num_computed_tokens} computed tokens without slots")
            assert not swapped, "the contiguous baselines have no swap space"

    def check_step(self, writes: list[StepWrite], block_copies: list[BlockCopy], swap_out: list[BlockCopy],
                   swap_in: list[BlockCopy]) -> None:
        """Regions are private: the step writes only into its sequences' own, current regions."""
        for w in writes:
            assert w.block_ids == self.block_ids(w.seq_id), f"sequence {w.seq_id}: stale block table in the step"
            assert w.start + w.num_new_tokens <= len(w.block_ids) * self.block_size, (
                f"sequence {w.seq_id}: no slot for its tokens")
        assert not (block_copies or swap_out or swap_in), "the contiguous baselines copy and swap nothing"
