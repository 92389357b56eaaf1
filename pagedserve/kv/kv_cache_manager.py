"""Block tables: the "page tables" of the paged KV cache.

One block table per sequence and KV group (kv/groups.py: a model's layers grouped by
attention kind; a model with full attention only has one group) maps logical block i
(token positions [i*B, (i+1)*B)) to a physical block of the one pool. Blocks are allocated
only when a token needs one, shared by reference count (fork), copied before a write into
a shared block (copy-on-write), and full blocks are registered in the prefix cache so later
sequences with the same prefix can reuse them.

A sliding-window group's table releases the blocks behind its window: when a step's first
query is at position c, no later query reads a position before c - W + 1, so the blocks
wholly before it go back to the pool (a block another table or the prefix cache still has
stays theirs: reference counts as ever). Released positions stay in the table as holes
(None), always a prefix of it, so logical block i stays at index i; the worker receives
them as -1 and never reads them.
A cached block records whether batch-invariant steps computed it (KVBlock.batch_invariant: each
row's arithmetic as alone; under batch_invariant "auto" only steps holding a greedy request are):
the scheduler reports each step that is not (`mark_batch_dependent`), and a greedy request's
lookup under "auto" (`invariant_only`) stops at the first block that is not such, recomputes from
there, and its own copy then replaces the other in the cache (BlockPool.cache). Keys stay the
tokens' (the router's and the tier's lookups are unchanged); the disk tier files a
batch-dependent block under a key of its own (kv/tier.py `tier_key`).
Swap space (preemption_mode="swap") is a collaborator, `self.swap` (kv/swap.py).
The scheduler uses the `KVCache` interface (kv/interface.py); the per-sequence
methods below it (`lookup_prefix`, `allocate`, `num_blocks_needed`) are this
manager's own. Pure Python: no tensors here.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pagedserve.kv.block_pool import (BlockKey, BlockPool, KVBlock, first_block_extra_keys, group_key,
                                      lookup_block_keys, partial_block_key, prefix_block_keys)
from pagedserve.kv.events import KVEventSink
from pagedserve.kv.fit import PagedFit
from pagedserve.kv.groups import first_needed_block, window_bound, window_name
from pagedserve.kv.interface import BlockCopy, KVCacheStats, PoolCapacity, SeqState, SlotRequest, StepWrite
from pagedserve.kv.memory_usage import MemoryUsage
from pagedserve.kv.snapshot import KVSnapshot, snapshot_pool
from pagedserve.kv.swap import SwapSpace, mirror_tables
from pagedserve.kv.tier import TierIndex, TierLink
from pagedserve.utils import cdiv

Table = list[KVBlock | None]      # a group's block table; None: a hole behind the window
ALL_BLOCKS = 1 << 62              # KVCacheManager.invariant_blocks of a sequence no batch-dependent step computed


@dataclass
class PrefixCacheStats:
    queries: int = 0   # prompt tokens looked up
    hits: int = 0      # of those, tokens found in the cache


@dataclass
class PrefixHit:
    """The longest cached prefix every group can serve: its blocks' chain keys, and per group
    the blocks to take (None where a window group needs no block: behind its window)."""
    keys: list[BlockKey]
    groups: list[Table]
    partial: KVBlock | None = None    # a cached partial block after them (one group only), taken over
    partial_tokens: int = 0           # the tokens it holds

    @property
    def num_blocks(self) -> int:
        return len(self.keys)


def held_blocks(table: Table) -> list[KVBlock]:
    """A table's blocks, holes left out."""
    return [b for b in table if b is not None]


class KVCacheManager(PoolCapacity):
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 num_host_blocks: int = 0, events: KVEventSink | None = None, kv_cache_dtype: str = "auto",
                 tier: TierIndex | None = None, windows: Sequence[int | None] = (None,),
                 max_step_tokens: int | None = None, partial_blocks: bool = False) -> None:
        """tier: the disk tier's keys below the pool (kv/tier.py); windows: each KV group's
        sliding window (None: full attention), kv/groups.py's order; max_step_tokens: the most
        tokens a sequence computes in one step (the scheduler's token budget), which bounds a
        window group's blocks during a prefill (None: a whole prompt at once); partial_blocks:
        a freed sequence's last, partly computed block stays cached (`_keep_partial_block`)."""
        self.block_size = block_size
        self.kv_cache_dtype = kv_cache_dtype         # in every first block's key (block_pool.first_block_extra_keys)
        self.enable_caching = enable_caching
        self.windows: tuple[int | None, ...] = tuple(windows)
        # Partial blocks only with one KV group (a window group's last block may be behind no window).
        self.partial_blocks = partial_blocks and enable_caching and all(w is None for w in self.windows) \
            and len(self.windows) == 1
        self.max_step_tokens = max_step_tokens
        self.pool = BlockPool(num_blocks, enable_caching, events)
        self.fit = PagedFit(num_blocks, block_size, self.windows, max_step_tokens)   # could a request ever fit
        # Per group, each sequence's table; group 0's is `tables`.
        self.group_tables: list[dict[int, Table]] = [{} for _ in self.windows]
        self.tables = self.group_tables[0]
        self.keys: dict[int, list[BlockKey]] = {}   # chain keys of each sequence's full blocks (kept while swapped)
        self.salts: dict[int, str | None] = {}       # each sequence's cache salt (part of its first key)
        # Each sequence's leading blocks that batch-invariant steps computed: blocks before this
        # index (ALL_BLOCKS: every one); a block's K and V depend on all before it.
        self.invariant_blocks: dict[int, int] = {}
        self.prefix_stats = PrefixCacheStats()
        self.num_logical_blocks = 0                  # live entries of all device tables, kept as they change
        self.swap = SwapSpace(self, num_host_blocks)
        # The tier below the pool (kv/tier.py): evicted cached blocks saved, tier hits read back.
        # With KV groups, every group's blocks go to the tier under their own keys (group_key).
        self.tier = TierLink(self.pool, tier) if tier is not None and enable_caching \
            else None
        # The tokens behind each prefix-cache key, so a snapshot can show a cached block's text
        # after its last owner is gone. Pruned to the keys still in use when it doubles.
        self.cached_tokens: dict[BlockKey, tuple[int, ...] | None] = {}   # None: salted, hidden

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def hybrid(self) -> bool:
        return any(w is not None for w in self.windows)

    # ---- queries (num_blocks, num_free_blocks, num_used_blocks: PoolCapacity) --------------
    def block_ids(self, seq_id: int) -> list[int]:
        """Group 0's table (-1 for a hole behind a window)."""
        return _ids(self.tables.get(seq_id, ()))

    def group_block_ids(self, seq_id: int) -> list[list[int]]:
        """The tables of groups 1.. (none for a model with one group)."""
        return [_ids(tables.get(seq_id, ())) for tables in self.group_tables[1:]]

    def num_held_blocks(self, seq_id: int) -> int:
        return sum(len(held_blocks(tables.get(seq_id, ()))) for tables in self.group_tables)

    def lookup_prefix(self, token_ids: list[int], cache_salt: str | None = None, invariant_only: bool = False) -> Table:
        """Group 0's blocks of the longest cached prefix (`lookup_prefix_hit`)."""
        return self.lookup_prefix_hit(token_ids, cache_salt, invariant_only).groups[0]

    def lookup_prefix_hit(self, token_ids: list[int], cache_salt: str | None = None,
                          invariant_only: bool = False) -> PrefixHit:
        """The longest cached prefix of token_ids, cached under the same salt (blocks of a request
        with another salt, or none, are never found), that every group can serve: a full group
        has all its blocks cached, a window group those covering the last W - 1 tokens (all the
        next query reads). invariant_only: of blocks that batch-invariant steps computed only (a
        greedy request's under batch_invariant "auto").

        At most len-1 tokens are matched: the last token is always computed, since its
        logits are what the next token is sampled from.
        """
        empty = PrefixHit([], [[] for _ in self.windows])
        if not self.enable_caching:
            return empty
        keys = lookup_block_keys(token_ids, self.block_size, cache_salt, self.kv_cache_dtype)
        found: dict[tuple[int, int], KVBlock | None] = {}

        def block(g: int, i: int) -> KVBlock | None:
            if (g, i) not in found:
                found[g, i] = self.pool.lookup(group_key(keys[i], g), invariant_only)
            return found[g, i]

        n = len(keys)
        for g, window in enumerate(self.windows):
            if window is None:
                n = next((i for i in range(n) if block(g, i) is None), n)
        while n > 0:   # a window group's miss at block i rules out every prefix whose window covers it
            miss = next((i for g, w in enumerate(self.windows) if w is not None
                         for i in range(n - 1, first_needed_block(w, n * self.block_size, self.block_size) - 1, -1)
                         if block(g, i) is None), None)
            if miss is None:
                break
            n = miss
        groups = [[None if i < first_needed_block(w, n * self.block_size, self.block_size) else block(g, i)
                   for i in range(n)] for g, w in enumerate(self.windows)]
        return PrefixHit(keys[:n], groups)

    def tier_fetch(self, owner: str, token_ids: list[int], cache_salt: str | None, reserve: int,
                   count: bool = True, invariant_only: bool = False) -> bool:
        """Read the tier's blocks of the prompt's prefix past the pool's hits ahead of its admission,
        if that admission would leave `reserve` blocks free (kv/tier.py). Returns whether it has
        loads to wait for. invariant_only: as `lookup_prefix_hit`'s."""
        keys = lookup_block_keys(token_ids, self.block_size, cache_salt, self.kv_cache_dtype)
        needed = cdiv(len(token_ids), self.block_size)
        partial = None
        if self.partial_blocks:     # a partial block after the run of keys the pool and the tier hold
            tier = self.tier

            def has(key: BlockKey) -> bool:
                return tier.source(key, invariant_only) is not None

            run = next((i for i, key in enumerate(keys) if not has(key)), len(keys))
            found = self._partial_key(token_ids, cache_salt, keys[:run], has)
            partial = (run, found[0]) if found else None
        started = self._tier_fetch_groups(owner, token_ids, keys, cache_salt, reserve, count, invariant_only) \
            if self.hybrid else self.tier.fetch(owner, keys, needed, reserve, self.block_size, count, partial,
                                                invariant_only)
        if not started:
            return False
        B = self.block_size
        for i, key in enumerate(keys):   # the dashboard's text of the blocks read back (hidden if salted)
            if self.tier.reading(key):
                self.cached_tokens[key] = None if cache_salt is not None else tuple(token_ids[i * B:(i + 1) * B])
        return True

    def _tier_fetch_groups(self, owner: str, token_ids: list[int], keys: list[BlockKey], cache_salt: str | None,
                           reserve: int, count: bool, invariant_only: bool) -> bool:
        """`tier_fetch` with KV groups: the longest prefix every group can serve from the pool and
        the tier together (a full group: all its blocks; a window group: those its window covers,
        as `lookup_prefix_hit`), its pool blocks pinned and its other blocks, each group's under its
        own key, read from the tier."""
        B, tier = self.block_size, self.tier
        in_pool = len(self.lookup_prefix_hit(token_ids, cache_salt, invariant_only).keys)

        def has(g: int, i: int) -> bool:
            return tier.source(group_key(keys[i], g), invariant_only) is not None

        n = len(keys)
        for g, window in enumerate(self.windows):
            if window is None:
                n = next((i for i in range(n) if not has(g, i)), n)
        while n > in_pool:   # a window group's miss at block i rules out every prefix whose window covers it
            miss = next((i for g, w in enumerate(self.windows) if w is not None
                         for i in range(n - 1, first_needed_block(w, n * B, B) - 1, -1) if not has(g, i)), None)
            if miss is None:
                break
            n = miss
        if count:
            tier.index.stats.queries += (len(keys) - in_pool) * B
            tier.index.stats.hits += max(0, n - in_pool) * B
        if n <= in_pool:
            return False
        hits, wanted, held = [], [], 0
        for g, w in enumerate(self.windows):
            for i in range(first_needed_block(w, n * B, B), n):
                source = tier.source(group_key(keys[i], g), invariant_only)
                if isinstance(source, KVBlock):
                    hits.append(source)
                else:
                    wanted.append(source)
            held += self._group_blocks_needed(w, len(token_ids))
        return tier.start(owner, hits, wanted, held - len(hits), reserve)

    def _partial_key(self, token_ids: list[int], cache_salt: str | None, keys: list[BlockKey],
                     has: Callable[[BlockKey], bool]) -> tuple[BlockKey, int] | None:
        """The longest partial block right after the full blocks of `keys` that `has` finds: its
        key and its tokens (fewer than a block, and never the prompt's last token)."""
        B, n = self.block_size, len(keys)
        extra = first_block_extra_keys(cache_salt, self.kv_cache_dtype) if n == 0 else ()
        for k in range(min(B - 1, len(token_ids) - 1 - n * B), 0, -1):
            key = partial_block_key(keys[-1] if keys else None, token_ids[n * B:n * B + k], extra)
            if has(key):
                return key, k
        return None

    def _keep_partial_block(self, seq_id: int, token_ids: Sequence[int], num_computed: int) -> None:
        """A sequence letting go of its blocks leaves its last, partly computed block in the prefix
        cache under the key of the tokens it holds (`partial_block_key`, chained on its full
        blocks), if no other table shares it. A later prompt that continues those tokens (a chat's
        next turn: the history ends in the previous answer) takes the block over as its own
        (`admit`) and computes only the rest of it; no copy, since slots past them are the taker's
        to write. Like any cached block it may be evicted to the tier, and read back from it."""
        n, k = divmod(num_computed, self.block_size)
        table, keys = self.tables.get(seq_id), self.keys.get(seq_id, [])
        if not self.partial_blocks or k == 0 or table is None or len(table) <= n or len(keys) != n \
                or num_computed > len(token_ids):
            return
        block = table[n]
        if block.ref_cnt != 1 or block.key is not None:
            return
        tokens = token_ids[n * self.block_size:num_computed]
        salt = self.salts[seq_id]
        key = partial_block_key(keys[-1] if n else None, tokens,
                                first_block_extra_keys(salt, self.kv_cache_dtype) if n == 0 else ())
        block.batch_invariant = block.batch_invariant and n < self.invariant_blocks[seq_id]
        self.pool.cache(block, key)
        self.cached_tokens[key] = None if salt is not None else tuple(tokens)

    def _group_blocks_needed(self, window: int | None, num_tokens: int) -> int:
        """Blocks a group's table holds after a prompt of num_tokens (at most a window's bound)."""
        blocks = cdiv(num_tokens, self.block_size)
        return blocks if window is None else min(blocks, window_bound(window, self.block_size))

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_stats.queries += num_tokens
        self.prefix_stats.hits += num_hit_tokens

    def num_blocks_needed(self, seq_id: int, num_computed: int, num_new: int,
                          prefix_blocks: Table = (), prefix: PrefixHit | None = None) -> int:
        """Free blocks that `allocate` with these arguments would take (new blocks,
        copy-on-write copies, and cached-but-free prefix blocks it would pull back)."""
        prefix_groups = self._prefix_groups(prefix_blocks, prefix)
        needed = 0
        for g, tables in enumerate(self.group_tables):
            table = tables.get(seq_id, ())
            taken = prefix_groups[g] if prefix_groups else ()
            held = len(table) or len(taken)
            needed += max(0, cdiv(num_computed + num_new, self.block_size) - held)
            needed += sum(1 for b in taken if b is not None and b.ref_cnt == 0)
            needed += len(self._shared_write_targets(table, num_computed, num_new))
        return needed

    def can_allocate(self, requests: list[tuple[int, int, int]]) -> bool:
        """Whether `allocate` can give every (seq_id, num_computed, num_new) its slots at once."""
        return sum(self.num_blocks_needed(*r) for r in requests) <= self.num_free_blocks

    def num_blocks_to_hold(self, seq_id: int, num_tokens: int) -> int:
        """Blocks the sequence must still take to hold its first num_tokens tokens (a window
        group: its window's)."""
        B = self.block_size
        out = 0
        for w, tables in zip(self.windows, self.group_tables):
            want = cdiv(num_tokens, B) if w is None else min(cdiv(num_tokens, B), window_bound(w, B))
            out += max(0, want - len(held_blocks(tables.get(seq_id, ()))))
        return out

    # ---- the scheduler's calls (kv/interface.py) -------------------------------------------
    def admit(self, seq_id: int, token_ids: list[int], max_len: int, cache_salt: str | None = None,
              use_prefix_cache: bool = True, invariant_only: bool = False, hit: Any = None) -> int:
        """Start the sequence's tables with the cached blocks of its longest cached prefix of
        `token_ids` (invariant_only: of blocks batch-invariant steps computed); returns the tokens
        they hold. Paging reserves nothing ahead (`max_len`). `hit`: cached_prefix's answer for
        these arguments, taken as it is (no second lookup; nothing may have changed the cache since)."""
        if not use_prefix_cache:
            hit = None
        elif hit is None:
            hit = self._lookup_with_partial(token_ids, cache_salt, invariant_only)
        self.allocate(seq_id, token_ids, 0, 0, prefix=hit, cache_salt=cache_salt)
        return hit.num_blocks * self.block_size + hit.partial_tokens if hit else 0

    def cached_prefix(self, token_ids: list[int], cache_salt: str | None = None,
                      invariant_only: bool = False) -> tuple[int, Any]:
        """The tokens `admit` would take from the prefix cache now, and the hit to hand it
        (changes nothing)."""
        hit = self._lookup_with_partial(token_ids, cache_salt, invariant_only)
        return hit.num_blocks * self.block_size + hit.partial_tokens, hit

    def cached_prefix_len(self, token_ids: list[int], cache_salt: str | None = None,
                          invariant_only: bool = False) -> int:
        """The tokens `admit` would take from the prefix cache now (changes nothing)."""
        return self.cached_prefix(token_ids, cache_salt, invariant_only)[0]

    def _lookup_with_partial(self, token_ids: list[int], cache_salt: str | None, invariant_only: bool) -> PrefixHit:
        """`lookup_prefix_hit`, and with partial blocks a free cached one after its full blocks."""
        hit = self.lookup_prefix_hit(token_ids, cache_salt, invariant_only)
        if self.partial_blocks:

            def free_cached(key: BlockKey) -> bool:
                block = self.pool.lookup(key, invariant_only)
                return block is not None and block.ref_cnt == 0

            found = self._partial_key(token_ids, cache_salt, hit.keys, free_cached)
            if found:
                hit.partial, hit.partial_tokens = self.pool.lookup(found[0]), found[1]
        return hit

    def allocate_slots(self, requests: list[SlotRequest]) -> list[BlockCopy] | None:
        if self.hybrid:   # blocks behind a window are free for this step's tokens
            for seq_id, _, computed, _ in requests:
                self._release_behind_windows(seq_id, computed)
        if not self.can_allocate([(seq_id, computed, new) for seq_id, _, computed, new in requests]):
            return None
        copies = []
        for seq_id, token_ids, computed, new in requests:
            copies += self.allocate(seq_id, token_ids, computed, new)
        return copies

    # ---- changes ---------------------------------------------------------------------------
    def allocate(self, seq_id: int, token_ids: list[int], num_computed: int, num_new: int,
                 prefix_blocks: Table = (), cache_salt: str | None = None,
                 prefix: PrefixHit | None = None) -> list[tuple[int, int]]:
        """Make room for tokens [num_computed, num_computed + num_new) of a sequence.

        A prefix-cache hit (only for a sequence with no table yet) is taken by reference
        first: `prefix` (lookup_prefix_hit), or for a one-group cache `prefix_blocks` (group 0's
        blocks, lookup_prefix); `cache_salt`, read when the tables are created, is the salt it
        was looked up with (it keys all of the sequence's blocks). A window group first releases
        the blocks behind its window. Returns the (src, dst) block copies the worker must do
        before the step: copy-on-write for shared blocks this step writes into.
        Call `num_blocks_needed` first: this raises if the pool runs dry half way.
        """
        assert seq_id not in self.swap.tables, f"sequence {seq_id} is swapped out: swap it in first"
        prefix_groups = self._prefix_groups(prefix_blocks, prefix)
        keys = self.keys.setdefault(seq_id, [])
        self.salts.setdefault(seq_id, cache_salt)
        if seq_id not in self.invariant_blocks:   # its prefix hit's blocks computed batch-dependently: from the first
            taken = [list(t) for t in prefix_groups or ()]
            if prefix is not None and prefix.partial is not None:   # (group 0's block after its full ones)
                taken[0].append(prefix.partial)
            self.invariant_blocks[seq_id] = min((i for t in taken for i, b in enumerate(t)
                                                 if b is not None and not b.batch_invariant), default=ALL_BLOCKS)
        copies = []
        for g, tables in enumerate(self.group_tables):
            table = tables.setdefault(seq_id, [])
            held = len(held_blocks(table))
            if prefix_groups and prefix_groups[g]:
                assert not table, "prefix blocks only attach to an empty block table"
                self.pool.touch(held_blocks(prefix_groups[g]))
                table.extend(prefix_groups[g])
            if g == 0 and prefix is not None and prefix.partial is not None:
                assert len(table) == prefix.num_blocks, "a partial block follows the prefix's full blocks"
                self.pool.take(prefix.partial)     # its own now: this sequence writes the rest of it
                table.append(prefix.partial)
            self.num_logical_blocks += len(held_blocks(table)) - held
            if self.windows[g] is not None:
                self._release_behind_window(g, table, num_computed)
            copies += self._allocate_group(table, num_computed, num_new)
        if prefix is not None:
            keys.extend(prefix.keys)
        elif prefix_blocks:
            keys.extend(b.key for b in prefix_blocks)   # one group: group 0's keys are the chain's
        # Only tokens the sequence has are hashed: slots past them (speculative drafts) are not
        # its tokens until accepted, and their block enters the prefix cache only then.
        self._cache_full_blocks(seq_id, token_ids, min(num_computed + num_new, len(token_ids)))
        return copies

    def _allocate_group(self, table: Table, num_computed: int, num_new: int) -> list[BlockCopy]:
        """One group's part of `allocate`: copy-on-write, then new blocks."""
        copies = []
        for i in self._shared_write_targets(table, num_computed, num_new):
            old = table[i]
            (new,) = self.pool.allocate(1)
            copies.append((old.block_id, new.block_id))
            self.pool.release([old])
            table[i] = new
        missing = cdiv(num_computed + num_new, self.block_size) - len(table)
        if missing > 0:
            table.extend(self.pool.allocate(missing))
            self.num_logical_blocks += missing
        # Invariant 2: a block with more than one reference is never written.
        assert not self._shared_write_targets(table, num_computed, num_new)
        return copies

    def _release_behind_windows(self, seq_id: int, num_computed: int) -> None:
        for g, window in enumerate(self.windows):
            table = self.group_tables[g].get(seq_id)
            if window is not None and table:
                self._release_behind_window(g, table, num_computed)

    def _release_behind_window(self, g: int, table: Table, num_computed: int) -> None:
        """Give back the blocks before the one the next query (at num_computed) needs first. Holes
        are a prefix of the table: walk back from there to the last hole."""
        i = min(first_needed_block(self.windows[g], num_computed, self.block_size), len(table)) - 1
        behind = []
        while i >= 0 and table[i] is not None:
            behind.append(table[i])       # the latest first: among cached blocks, evicted last
            table[i] = None
            i -= 1
        if behind:
            self.num_logical_blocks -= len(behind)
            self.pool.release(behind)

    def mark_batch_dependent(self, writes: list[tuple[int, int]]) -> None:
        """The step about to run is not batch-invariant: each (seq_id, start) computes the
        sequence's tokens from `start` on with arithmetic that depends on the batch, so its
        blocks from there on (cached already at `allocate`, or when they fill) are not invariant."""
        B = self.block_size
        for seq_id, start in writes:
            first = start // B
            self.invariant_blocks[seq_id] = min(self.invariant_blocks[seq_id], first)
            for tables in self.group_tables:
                for block in tables[seq_id][first:]:
                    if block is not None:
                        block.batch_invariant = False

    def trim(self, seq_id: int, num_tokens: int) -> None:
        """Release the blocks past the first num_tokens slots (rejected drafts' slots): they
        hold no token of the sequence, so they were never hashed."""
        keep = cdiv(num_tokens, self.block_size)
        for tables in self.group_tables:
            table = tables[seq_id]
            if len(table) > keep:
                assert len(self.keys[seq_id]) <= keep, f"sequence {seq_id}: a trimmed block was hashed"
                self._release(table[keep:])
                del table[keep:]

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares every block of the parent (copy-on-write later)."""
        for tables in self.group_tables:
            blocks = tables[parent_id]
            held = held_blocks(blocks)
            self.pool.touch(held)
            tables[child_id] = list(blocks)
            self.num_logical_blocks += len(held)
        self.keys[child_id] = list(self.keys[parent_id])
        self.salts[child_id] = self.salts[parent_id]
        self.invariant_blocks[child_id] = self.invariant_blocks[parent_id]

    def free(self, seq_id: int, token_ids: Sequence[int] = (), num_computed: int = 0) -> None:
        """Drop a sequence's tables (on the device or in swap space). Tail blocks are released
        first so that, among cached blocks, a prefix's later blocks are evicted before its
        earlier ones. With its tokens and computed count, its last partly computed block stays
        cached (`_keep_partial_block`, if partial_blocks)."""
        self._keep_partial_block(seq_id, token_ids, num_computed)
        self.release_tables([seq_id])
        self.keys.pop(seq_id, None)
        self.salts.pop(seq_id, None)
        self.invariant_blocks.pop(seq_id, None)
        self.swap.free(seq_id)

    # ---- swap space's part (kv/swap.py): device tables leave and come back only here --------
    def device_tables(self, seq_ids: list[int]) -> list[dict[int, Table]]:
        """Per group, the device tables of those of the sequences that have one (read only)."""
        return [{sid: tables[sid] for sid in seq_ids if sid in tables} for tables in self.group_tables]

    def release_tables(self, seq_ids: list[int]) -> None:
        """Drop the sequences' device tables (their keys stay, for swapping back in). Tail
        blocks are released first so that, among cached blocks, a prefix's later blocks are
        evicted before its earlier ones."""
        for sid in seq_ids:
            for tables in self.group_tables:
                self._release(tables.pop(sid, []))

    def _release(self, blocks: Table) -> None:
        """Give a table's blocks (or its tail) back to the pool, the last first."""
        held = held_blocks(blocks)
        self.num_logical_blocks -= len(held)
        self.pool.release(held[::-1])

    def restore_tables(self, group_tables: list[dict[int, Table]]) -> list[BlockCopy]:
        """Give swapped-out sequences device tables again, mirroring `group_tables` (their host
        tables, per group); their full blocks enter the prefix cache again. Returns the (host,
        device) copies; allocates nothing if the pool is short (NoFreeBlocksError)."""
        flat = {(g, sid): t for g, tables in enumerate(group_tables) for sid, t in tables.items()}
        restored, moved = mirror_tables(flat, self.pool)
        for (g, sid), table in restored.items():
            self.group_tables[g][sid] = table
            self.num_logical_blocks += len(held_blocks(table))
            for block, key in zip(table, self.keys.get(sid, ())):
                if block is not None:
                    self.pool.cache(block, group_key(key, g))
        return moved

    # ---- internals -------------------------------------------------------------------------
    def _prefix_groups(self, prefix_blocks: Table, prefix: PrefixHit | None) -> list[Table] | None:
        if prefix is not None:
            return prefix.groups
        if prefix_blocks:
            assert self.num_groups == 1, "a cache of several groups takes a PrefixHit"
            return [list(prefix_blocks)]
        return None

    def _shared_write_targets(self, table: Table, num_computed: int, num_new: int) -> list[int]:
        if num_new <= 0:
            return []
        first = num_computed // self.block_size
        last = min((num_computed + num_new - 1) // self.block_size, len(table) - 1)
        return [i for i in range(first, last + 1) if table[i].ref_cnt > 1]

    def _cache_full_blocks(self, seq_id: int, token_ids: list[int], num_tokens: int) -> None:
        if not self.enable_caching:
            return
        keys = self.keys[seq_id]
        new = list(prefix_block_keys(token_ids, self.block_size, num_tokens // self.block_size,
                                     self.salts[seq_id], known=keys, kv_cache_dtype=self.kv_cache_dtype))
        B = self.block_size
        salted = self.salts[seq_id] is not None   # a tenant's blocks: no one else sees their tokens
        invariant = self.invariant_blocks[seq_id]
        for g, tables in enumerate(self.group_tables):
            table = tables[seq_id]
            for i, key in enumerate(new, start=len(keys)):
                gkey = group_key(key, g)
                if table[i] is not None:
                    table[i].batch_invariant = table[i].batch_invariant and i < invariant
                    self.pool.cache(table[i], gkey)
                self.cached_tokens[gkey] = None if salted else tuple(token_ids[i * B:(i + 1) * B])
        keys.extend(new)
        # At most one live key per block of either pool, so pruning at twice that frees half or more.
        if len(self.cached_tokens) > 2 * (self.pool.num_blocks + self.swap.num_blocks) + 64:
            self._prune_cached_tokens()

    def _prune_cached_tokens(self) -> None:
        """Keep the tokens of keys still cached or held by a sequence (a swapped-out one's come
        back into the cache when it is swapped in)."""
        live_keys = set(self.pool.cached).union(*self.keys.values())
        live_keys.update(group_key(k, g) for g in range(1, self.num_groups) for keys in self.keys.values()
                         for k in keys)
        self.cached_tokens = {k: v for k, v in self.cached_tokens.items() if k in live_keys}

    # ---- accounting ------------------------------------------------------------------------
    def snapshot(self) -> KVSnapshot:
        """A copy of the blocks' reference counts and keys, the tables, and swap space (see
        kv/snapshot.py). Cheap: flat list copies; the tokens' dict is copied whole (its values are
        immutable tuples). With several groups, a sequence's table is its groups' live blocks in
        group order, and `group_of_block` says which group holds each block."""
        tables = self.tables if self.num_groups == 1 else self._joined_tables(self.group_tables)
        snap = KVSnapshot(self.block_size, snapshot_pool(self.pool.blocks, tables), self.swap.snapshot(),
                          dict(self.cached_tokens))
        if self.num_groups > 1:
            snap.group_of_block.update((b.block_id, g) for g, tables in enumerate(self.group_tables)
                                       for t in tables.values() for b in t if b is not None)
        return snap

    @staticmethod
    def _joined_tables(group_tables: list[dict[int, Table]]) -> dict[int, list[KVBlock]]:
        out: dict[int, list[KVBlock]] = {}
        for tables in group_tables:
            for sid, t in tables.items():
                out.setdefault(sid, []).extend(held_blocks(t))
        return out

    def stats(self) -> KVCacheStats:
        pool, swap = self.pool, self.swap
        tier = {}
        if self.tier is not None:
            t = self.tier.index.stats
            tier = dict(kv_offload_blocks=len(self.tier.index), kv_offload_queries=t.queries, kv_offload_hits=t.hits,
                        kv_offload_blocks_saved=t.blocks_saved, kv_offload_blocks_loaded=t.blocks_loaded,
                        kv_offload_load_failures=t.load_failures, kv_offload_bytes_written=t.bytes_written,
                        kv_offload_bytes_read=t.bytes_read, kv_offload_host_blocks=t.host_blocks,
                        kv_offload_host_loads=t.host_loads)
        stats = KVCacheStats(
            num_blocks=pool.num_blocks, block_size=self.block_size, num_free_blocks=pool.num_free_blocks,
            num_used_blocks=self.num_used_blocks, num_cached_blocks=len(pool.cached),
            prefix_cache_queries=self.prefix_stats.queries, prefix_cache_hits=self.prefix_stats.hits,
            num_logical_blocks=self.num_logical_blocks, num_evicted_blocks=pool.num_evictions,
            num_host_blocks=swap.num_blocks, num_free_host_blocks=swap.num_free_blocks,
            num_swapped_out_blocks=swap.num_swapped_out_blocks, num_swapped_in_blocks=swap.num_swapped_in_blocks,
            **tier)
        if self.hybrid:
            stats.kv_groups = [window_name(w) for w in self.windows]
            stats.num_blocks_per_group = self.blocks_per_group()
        return stats

    def blocks_per_group(self) -> list[int]:
        """Distinct device blocks each group's tables hold now (a window table read back from its
        end to its first hole: its live blocks only)."""
        return [len({id(b) for t in tables.values() for b in _live_tail(t)}) for tables in self.group_tables]

    def memory_usage(self, seqs: list[tuple[int, int, int]], waiting_max_len: int | None = None) -> MemoryUsage:
        """Slots by category (see memory_usage.py) for the sequences (seq_id, computed tokens,
        final length). A block shared by several sequences is counted once, for the first.
        No external fragmentation: any free block can hold any token."""
        B = self.block_size
        usage = MemoryUsage()
        seen: set[int] = set()
        for tables in self.group_tables:
            for seq_id, written, final_len in seqs:
                for i, block in enumerate(tables.get(seq_id, ())):
                    if block is not None and block.block_id not in seen:
                        seen.add(block.block_id)
                        usage.add_held(i * B, B, written, final_len)
        usage.free = self.pool.num_free_blocks * B
        return usage

    # ---- invariants (pagedserve/invariants.py calls these) ---------------------------------
    def check_invariants(self, live: dict[int, SeqState] | None = None, swapped: set[int] = frozenset()) -> None:
        """Invariants 1 and 3 (docs/architecture.md), in both pools, plus the free queues and the prefix-cache
        index; with `live` and `swapped`, who may hold blocks, that computed tokens have slots
        and that window groups hold what their windows need and no more."""
        host_groups = self.swap.group_tables
        tier_held = self.tier.held() if self.tier is not None else []   # loads in flight, waiting requests' pins
        for pool, groups, more in ((self.pool, self.group_tables, tier_held), (self.swap.pool, host_groups, [])):
            tables = [t for g in groups for t in g.values()]
            holders = Counter(b.block_id for t in (*tables, *more) for b in t if b is not None)
            for t in tables:
                held = held_blocks(t)
                assert len({b.block_id for b in held}) == len(held), "a block appears twice in one table"
                assert all(pool.blocks[b.block_id] is b for b in held), "a table holds a block of the other pool"
                assert all(b is None for b in t[:len(t) - len(held)]), "a table's holes are not a prefix of it"
            for block in pool.blocks:
                assert block.ref_cnt == holders[block.block_id], (
                    f"block {block.block_id}: ref_cnt {block.ref_cnt} != {holders[block.block_id]} tables")
                assert (block.ref_cnt == 0) == (block.block_id in pool.free_queue), (
                    f"block {block.block_id}: ref_cnt {block.ref_cnt} but free-queue membership wrong")
            assert all(set(g) == set(groups[0]) for g in groups), "a sequence lacks a table in some group"
        for g, window in enumerate(self.windows):
            if window is None:
                assert all(b is not None for t in self.group_tables[g].values() for b in t), (
                    f"group {g} (full attention) has a hole")
        for key, block in self.pool.cached.items():
            assert block.key == key, f"cache index points at block {block.block_id} with another key"
        assert not self.swap.pool.cached, "host blocks are never in the prefix cache"
        host_tables = self.swap.tables
        assert not set(self.tables) & set(host_tables), "a sequence is both on the device and swapped"
        assert set(self.keys) == set(self.salts) == set(self.invariant_blocks) == set(self.tables) | set(host_tables)
        self._check_prefix_index()
        if live is not None:
            self._check_tables(live)
            self._check_swapped(set(swapped), host_tables)
        assert self.num_logical_blocks == sum(len(held_blocks(t)) for g in self.group_tables for t in g.values()), (
            "logical block count drifted")

    def _check_prefix_index(self) -> None:
        """The prefix-cache index and the blocks agree, and each table's keys match its blocks."""
        pool = self.pool
        assert all(pool.blocks[i] is b for i, b in pool.free_queue.items()), "free queue entry under a wrong id"
        for block in pool.blocks:
            assert block.key is None or pool.cached.get(block.key) is block, (
                f"block {block.block_id} has a prefix key but the cache index does not point at it")
        assert self.enable_caching or not pool.cached, "blocks cached with prefix caching off"
        for g in range(self.num_groups):
            device, host = self.group_tables[g], self.swap.group_tables[g]
            for seq_id, keys in self.keys.items():
                table = device.get(seq_id) or host.get(seq_id, [])
                assert len(keys) <= len(table), f"sequence {seq_id}: more prefix keys than blocks"
                for block, key in zip(table, keys):
                    assert block is None or block.key in (None, group_key(key, g)), (
                        f"sequence {seq_id}: block {block.block_id} is cached under another prefix or group")

    def _check_tables(self, live: dict[int, SeqState]) -> None:
        """Only live sequences of running requests hold device blocks (so a finished, aborted or
        recompute-preempted request holds none); computed tokens have slots; prefix-cache keys
        are those of the sequence's tokens and its request's cache salt. A window group's table
        holds every block its next queries read (those from num_computed - W + 1 on), and in the
        step about to run (num_new_tokens set), none before them: at most window_bound blocks,
        ceil(W / B) + 1 for a decode plus those its drafts need."""
        B = self.block_size
        stray = set(self.tables) - set(live)
        assert not stray, f"sequences {sorted(stray)} hold blocks but are not live in a running request"
        for seq_id, seq in live.items():
            slots = len(seq.token_ids) + seq.num_draft_slots    # drafts: slots past the tokens, this step
            c = seq.num_computed_tokens
            for g, window in enumerate(self.windows):
                table = self.group_tables[g].get(seq_id, ())
                assert cdiv(c, B) <= len(table) <= cdiv(slots, B), (
                    f"sequence {seq_id}: {len(table)} blocks for {c} computed of {len(seq.token_ids)} tokens")
                first = first_needed_block(window, c, B)
                assert all(b is not None for b in table[first:]), (
                    f"sequence {seq_id}: group {g} released a block its window still reads")
                if window is not None and seq.num_new_tokens:
                    step = seq.num_new_tokens + seq.num_draft_slots
                    held = len(held_blocks(table))
                    assert held == len(table) - first, (
                        f"sequence {seq_id}: group {g} holds blocks behind its window of {window}")
                    assert held <= window_bound(window, B, step), (
                        f"sequence {seq_id}: group {g} holds {held} blocks, more than its window's "
                        f"{window_bound(window, B, step)}")
            keys = self.keys.get(seq_id, [])
            assert seq_id not in self.salts or self.salts[seq_id] == seq.cache_salt, (
                f"sequence {seq_id}: its cache salt is not its request's")
            expected = prefix_block_keys(seq.token_ids, B, len(keys), seq.cache_salt, kv_cache_dtype=self.kv_cache_dtype)
            for i, (key, want) in enumerate(zip(keys, expected)):
                assert key == want, f"sequence {seq_id}: prefix-cache key of block {i} is not its tokens' and salt's"

    def _check_swapped(self, swapped: set[int], host_tables: dict) -> None:
        """Only live sequences of swapped-out requests hold host blocks, and those hold no
        device blocks."""
        stray = set(host_tables) - swapped
        assert not stray, f"sequences {sorted(stray)} hold host blocks but are not live in a swapped request"
        on_device = swapped & set(self.tables)
        assert not on_device, f"swapped-out sequences {sorted(on_device)} still hold device blocks"

    def check_step(self, writes: list[StepWrite], block_copies: list[BlockCopy], swap_out: list[BlockCopy],
                   swap_in: list[BlockCopy]) -> None:
        """The step about to run writes only blocks its sequence alone holds, in every group.

        One exception is safe and expected: a block registered in the prefix cache while this
        step fills it (by its writes, after a copy-on-write copy) may be picked up by a request
        admitted later in the same step. Every holder then expects exactly the tokens being
        written (they share the block's key), and each layer writes the whole batch's keys and
        values before attending.
        """
        B = self.block_size
        written: set[int] = set()
        for w in writes:
            assert len(w.group_block_ids) == self.num_groups - 1, f"sequence {w.seq_id}: tables of other groups"
            for g, ids in enumerate([w.block_ids, *w.group_block_ids]):
                tables = self.group_tables[g]
                table = tables.get(w.seq_id, [])
                assert ids == _ids(table), f"sequence {w.seq_id}: stale block table in the step"
                assert len(table) >= cdiv(w.start + w.num_new_tokens, B), f"sequence {w.seq_id}: no slot for its tokens"
                for i in range(w.start // B, (w.start + w.num_new_tokens - 1) // B + 1):
                    block = table[i]
                    assert block is not None, f"sequence {w.seq_id} writes into a hole (logical {i}, group {g})"
                    written.add(block.block_id)
                    if block.ref_cnt > 1:   # (a batch-invariant copy may have taken its key since: BlockPool.cache)
                        holders = [sid for sid, t in tables.items() if i < len(t) and t[i] is block]
                        expected = {group_key(self.keys[h][i], g) if i < len(self.keys[h]) else None for h in holders}
                        assert len(holders) == block.ref_cnt and len(expected) == 1 and None not in expected and \
                            block.key in (None, *expected), (
                            f"sequence {w.seq_id} writes block {block.block_id} (logical {i}), which "
                            f"{block.ref_cnt} tables hold")
        dsts = [dst for _, dst in block_copies]
        assert len(set(dsts)) == len(dsts), "two copies into one block"
        for src, dst in block_copies:   # (whether dst may be shared was checked with the writes)
            assert src != dst and dst in written, f"copy-on-write {src} -> {dst}: the copy is not written this step"
        # Swaps run before the copies: each lands in a distinct block that a table holds.
        for name, pool, moves in (("swap_out", self.swap.pool, swap_out), ("swap_in", self.pool, swap_in)):
            dsts = [dst for _, dst in moves]
            assert len(set(dsts)) == len(dsts), f"{name}: two blocks moved into one"
            assert all(pool.blocks[d].ref_cnt > 0 for d in dsts), f"{name}: a block moved into a free block"


def _live_tail(table: Table):
    """A table's blocks from its end back to its last hole (holes are a prefix)."""
    for b in reversed(table):
        if b is None:
            return
        yield b


def _ids(table: Table) -> list[int]:
    """A table as the worker receives it: block ids, -1 for a hole behind a window."""
    return [-1 if b is None else b.block_id for b in table]
