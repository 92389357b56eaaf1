"""Block tables: the "page tables" of the paged KV cache.

One block table per sequence maps logical block i (token positions
[i*B, (i+1)*B)) to a physical block. Blocks are allocated only when a token
needs one, shared by reference count (fork), copied before a write into a
shared block (copy-on-write), and full blocks are registered in the prefix
cache so later sequences with the same prefix can reuse them.
Swap space (preemption_mode="swap") is a collaborator, `self.swap` (kv/swap.py).
The scheduler uses the `KVCache` interface (kv/interface.py); the per-sequence
methods below it (`lookup_prefix`, `allocate`, `num_blocks_needed`) are this
manager's own. Pure Python: no tensors here.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from pagedserve.errors import InvalidRequestError
from pagedserve.kv.block_pool import BlockKey, BlockPool, KVBlock, lookup_block_keys, prefix_block_keys
from pagedserve.kv.events import KVEventSink
from pagedserve.kv.interface import BlockCopy, KVCacheStats, PoolCapacity, SeqState, SlotRequest, StepWrite
from pagedserve.kv.memory_usage import MemoryUsage
from pagedserve.kv.snapshot import KVSnapshot, snapshot_pool
from pagedserve.kv.swap import SwapSpace, mirror_tables
from pagedserve.kv.tier import TierIndex, TierLink
from pagedserve.utils import cdiv


@dataclass
class PrefixCacheStats:
    queries: int = 0   # prompt tokens looked up
    hits: int = 0      # of those, tokens found in the cache


class KVCacheManager(PoolCapacity):
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 num_host_blocks: int = 0, events: KVEventSink | None = None, kv_cache_dtype: str = "auto",
                 tier: TierIndex | None = None) -> None:
        self.block_size = block_size
        self.kv_cache_dtype = kv_cache_dtype         # in every first block's key (block_pool.first_block_extra_keys)
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching, events)
        self.tables: dict[int, list[KVBlock]] = {}
        self.keys: dict[int, list[BlockKey]] = {}   # keys of each sequence's full blocks (kept while swapped)
        self.salts: dict[int, str | None] = {}       # each sequence's cache salt (part of its first key)
        self.prefix_stats = PrefixCacheStats()
        self.num_logical_blocks = 0                  # entries of all device tables, kept as they change
        self.swap = SwapSpace(self, num_host_blocks)
        # The tier below the pool (kv/tier.py): evicted cached blocks saved, tier hits read back.
        self.tier = TierLink(self.pool, tier) if tier is not None and enable_caching else None
        # The tokens behind each prefix-cache key, so a snapshot can show a cached block's text
        # after its last owner is gone. Pruned to the keys still in use when it doubles.
        self.cached_tokens: dict[BlockKey, tuple[int, ...] | None] = {}   # None: salted, hidden

    # ---- queries (num_blocks, num_free_blocks, num_used_blocks: PoolCapacity) --------------
    def block_ids(self, seq_id: int) -> list[int]:
        return [b.block_id for b in self.tables.get(seq_id, ())]

    def num_held_blocks(self, seq_id: int) -> int:
        return len(self.tables.get(seq_id, ()))

    def lookup_prefix(self, token_ids: list[int], cache_salt: str | None = None) -> list[KVBlock]:
        """The cached blocks of the longest cached prefix of token_ids, cached under the same
        salt (blocks of a request with another salt, or none, are never found).

        At most len-1 tokens are matched: the last token is always computed, since its
        logits are what the next token is sampled from.
        """
        if not self.enable_caching:
            return []
        hits: list[KVBlock] = []
        for key in lookup_block_keys(token_ids, self.block_size, cache_salt, self.kv_cache_dtype):
            block = self.pool.lookup(key)
            if block is None:
                break
            hits.append(block)
        return hits

    def tier_fetch(self, owner: str, token_ids: list[int], cache_salt: str | None, room: int,
                   count: bool = True) -> bool:
        """Read the tier's blocks of the prompt's prefix past the pool's hits into at most `room`
        new blocks, ahead of its admission (kv/tier.py). Returns whether it has loads to wait for."""
        keys = lookup_block_keys(token_ids, self.block_size, cache_salt, self.kv_cache_dtype)
        if not self.tier.fetch(owner, keys, room, self.block_size, count):
            return False
        B = self.block_size
        for i, key in enumerate(keys):   # the dashboard's text of the blocks read back (hidden if salted)
            if key in self.tier.loading:
                self.cached_tokens[key] = None if cache_salt is not None else tuple(token_ids[i * B:(i + 1) * B])
        return True

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_stats.queries += num_tokens
        self.prefix_stats.hits += num_hit_tokens

    def num_blocks_needed(self, seq_id: int, num_computed: int, num_new: int,
                          prefix_blocks: list[KVBlock] = ()) -> int:
        """Free blocks that `allocate` with these arguments would take (new blocks,
        copy-on-write copies, and cached-but-free prefix blocks it would pull back)."""
        table = self.tables.get(seq_id, ())
        held = len(table) or len(prefix_blocks)
        needed = max(0, cdiv(num_computed + num_new, self.block_size) - held)
        needed += sum(1 for b in prefix_blocks if b.ref_cnt == 0)
        needed += len(self._shared_write_targets(table, num_computed, num_new))
        return needed

    def can_allocate(self, requests: list[tuple[int, int, int]]) -> bool:
        """Whether `allocate` can give every (seq_id, num_computed, num_new) its slots at once."""
        return sum(self.num_blocks_needed(*r) for r in requests) <= self.num_free_blocks

    def max_blocks_needed(self, prompt_len: int, max_tokens: int, max_seqs: int) -> int:
        """Blocks a request needs at its largest (its sequences share the prompt's blocks)."""
        B = self.block_size
        if max_seqs == 1:
            return cdiv(prompt_len + max_tokens, B)
        return cdiv(prompt_len, B) + max_seqs * (cdiv(max_tokens, B) + 1)

    def check_request(self, prompt_len: int, max_tokens: int, max_seqs: int = 1, shares_blocks: bool = False) -> None:
        needed = self.max_blocks_needed(prompt_len, max_tokens, max_seqs)
        if needed > self.pool.num_blocks:
            raise InvalidRequestError(
                f"request can never fit in the KV cache: its prompt ({prompt_len} tokens) plus max_tokens "
                f"({max_tokens}) {'over ' + str(max_seqs) + ' sequences ' if max_seqs > 1 else ''}"
                f"needs {needed} blocks of {self.block_size} tokens, and the cache has "
                f"{self.pool.num_blocks}; raise kv_cache_memory or lower max_tokens")

    # ---- the scheduler's calls (kv/interface.py) -------------------------------------------
    def admit(self, seq_id: int, token_ids: list[int], max_len: int, cache_salt: str | None = None,
              use_prefix_cache: bool = True) -> int:
        """Start the sequence's table with the cached blocks of its longest cached prefix of
        `token_ids`; returns the tokens they hold. Paging reserves nothing ahead (`max_len`)."""
        hits = self.lookup_prefix(token_ids, cache_salt) if use_prefix_cache else []
        self.allocate(seq_id, token_ids, 0, 0, prefix_blocks=hits, cache_salt=cache_salt)
        return len(hits) * self.block_size

    def allocate_slots(self, requests: list[SlotRequest]) -> list[BlockCopy] | None:
        if not self.can_allocate([(seq_id, computed, new) for seq_id, _, computed, new in requests]):
            return None
        copies = []
        for seq_id, token_ids, computed, new in requests:
            copies += self.allocate(seq_id, token_ids, computed, new)
        return copies

    # ---- changes ---------------------------------------------------------------------------
    def allocate(self, seq_id: int, token_ids: list[int], num_computed: int, num_new: int,
                 prefix_blocks: list[KVBlock] = (), cache_salt: str | None = None) -> list[tuple[int, int]]:
        """Make room for tokens [num_computed, num_computed + num_new) of a sequence.

        `prefix_blocks` (prefix-cache hits, only for a sequence with no table yet) are
        taken by reference first; `cache_salt`, read when the table is created, is the salt
        they were looked up with (it keys all of the sequence's blocks). Returns the (src, dst)
        block copies the worker must do before the step: copy-on-write for shared blocks this
        step writes into.
        Call `num_blocks_needed` first: this raises if the pool runs dry half way.
        """
        assert seq_id not in self.swap.tables, f"sequence {seq_id} is swapped out: swap it in first"
        table = self.tables.setdefault(seq_id, [])
        held = len(table)
        keys = self.keys.setdefault(seq_id, [])
        self.salts.setdefault(seq_id, cache_salt)
        if prefix_blocks:
            assert not table, "prefix blocks only attach to an empty block table"
            self.pool.touch(list(prefix_blocks))
            table.extend(prefix_blocks)
            keys.extend(b.key for b in prefix_blocks)

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
        self.num_logical_blocks += len(table) - held
        # Invariant 2: a block with more than one reference is never written.
        assert not self._shared_write_targets(table, num_computed, num_new)
        # Only tokens the sequence has are hashed: slots past them (speculative drafts) are not
        # its tokens until accepted, and their block enters the prefix cache only then.
        self._cache_full_blocks(seq_id, token_ids, min(num_computed + num_new, len(token_ids)))
        return copies

    def trim(self, seq_id: int, num_tokens: int) -> None:
        """Release the blocks past the first num_tokens slots (rejected drafts' slots): they
        hold no token of the sequence, so they were never hashed."""
        table = self.tables[seq_id]
        keep = cdiv(num_tokens, self.block_size)
        if len(table) > keep:
            assert len(self.keys[seq_id]) <= keep, f"sequence {seq_id}: a trimmed block was hashed"
            self._release(table[keep:])
            del table[keep:]

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares every block of the parent (copy-on-write later)."""
        blocks = self.tables[parent_id]
        self.pool.touch(blocks)
        self.tables[child_id] = list(blocks)
        self.num_logical_blocks += len(blocks)
        self.keys[child_id] = list(self.keys[parent_id])
        self.salts[child_id] = self.salts[parent_id]

    def free(self, seq_id: int) -> None:
        """Drop a sequence's table (on the device or in swap space). Tail blocks are released
        first so that, among cached blocks, a prefix's later blocks are evicted before its
        earlier ones."""
        self.release_tables([seq_id])
        self.keys.pop(seq_id, None)
        self.salts.pop(seq_id, None)
        self.swap.free(seq_id)

    # ---- swap space's part (kv/swap.py): device tables leave and come back only here --------
    def device_tables(self, seq_ids: list[int]) -> dict[int, list[KVBlock]]:
        """The device tables of those of the sequences that have one (read only)."""
        return {sid: self.tables[sid] for sid in seq_ids if sid in self.tables}

    def release_tables(self, seq_ids: list[int]) -> None:
        """Drop the sequences' device tables (their keys stay, for swapping back in). Tail
        blocks are released first so that, among cached blocks, a prefix's later blocks are
        evicted before its earlier ones."""
        for sid in seq_ids:
            self._release(self.tables.pop(sid, []))

    def _release(self, blocks: list[KVBlock]) -> None:
        """Give a table's blocks (or its tail) back to the pool, the last first."""
        self.num_logical_blocks -= len(blocks)
        self.pool.release(blocks[::-1])

    def restore_tables(self, tables: dict[int, list[KVBlock]]) -> list[BlockCopy]:
        """Give swapped-out sequences device tables again, mirroring `tables` (their host
        tables); their full blocks enter the prefix cache again. Returns the (host, device)
        copies; allocates nothing if the pool is short (NoFreeBlocksError)."""
        restored, moved = mirror_tables(tables, self.pool)
        for sid, table in restored.items():
            self.tables[sid] = table
            self.num_logical_blocks += len(table)
        for sid, table in restored.items():
            for block, key in zip(table, self.keys.get(sid, ())):
                self.pool.cache(block, key)
        return moved

    # ---- internals -------------------------------------------------------------------------
    def _shared_write_targets(self, table, num_computed: int, num_new: int) -> list[int]:
        if num_new <= 0:
            return []
        first = num_computed // self.block_size
        last = min((num_computed + num_new - 1) // self.block_size, len(table) - 1)
        return [i for i in range(first, last + 1) if table[i].ref_cnt > 1]

    def _cache_full_blocks(self, seq_id: int, token_ids: list[int], num_tokens: int) -> None:
        if not self.enable_caching:
            return
        table, keys = self.tables[seq_id], self.keys[seq_id]
        new = list(prefix_block_keys(token_ids, self.block_size, num_tokens // self.block_size,
                                     self.salts[seq_id], known=keys, kv_cache_dtype=self.kv_cache_dtype))
        B = self.block_size
        salted = self.salts[seq_id] is not None   # a tenant's blocks: no one else sees their tokens
        for i, key in enumerate(new, start=len(keys)):
            self.pool.cache(table[i], key)
            self.cached_tokens[key] = None if salted else tuple(token_ids[i * B:(i + 1) * B])
        keys.extend(new)
        # At most one live key per block of either pool, so pruning at twice that frees half or more.
        if len(self.cached_tokens) > 2 * (self.pool.num_blocks + self.swap.num_blocks) + 64:
            self._prune_cached_tokens()

    def _prune_cached_tokens(self) -> None:
        """Keep the tokens of keys still cached or held by a sequence (a swapped-out one's come
        back into the cache when it is swapped in)."""
        live = set(self.pool.cached).union(*self.keys.values())
        self.cached_tokens = {k: v for k, v in self.cached_tokens.items() if k in live}

    # ---- accounting ------------------------------------------------------------------------
    def snapshot(self) -> KVSnapshot:
        """A copy of the blocks' reference counts and keys, the tables, and swap space (see
        kv/snapshot.py). Cheap: flat list copies; the tokens' dict is copied whole (its values are
        immutable tuples)."""
        return KVSnapshot(self.block_size, snapshot_pool(self.pool.blocks, self.tables), self.swap.snapshot(),
                          dict(self.cached_tokens))

    def stats(self) -> KVCacheStats:
        pool, swap = self.pool, self.swap
        tier = {}
        if self.tier is not None:
            t = self.tier.index.stats
            tier = dict(kv_offload_blocks=len(self.tier.index), kv_offload_queries=t.queries, kv_offload_hits=t.hits,
                        kv_offload_blocks_saved=t.blocks_saved, kv_offload_blocks_loaded=t.blocks_loaded,
                        kv_offload_load_failures=t.load_failures, kv_offload_bytes_written=t.bytes_written,
                        kv_offload_bytes_read=t.bytes_read)
        return KVCacheStats(
            num_blocks=pool.num_blocks, block_size=self.block_size, num_free_blocks=pool.num_free_blocks,
            num_used_blocks=self.num_used_blocks, num_cached_blocks=len(pool.cached),
            prefix_cache_queries=self.prefix_stats.queries, prefix_cache_hits=self.prefix_stats.hits,
            num_logical_blocks=self.num_logical_blocks, num_evicted_blocks=pool.num_evictions,
            num_host_blocks=swap.num_blocks, num_free_host_blocks=swap.num_free_blocks,
            num_swapped_out_blocks=swap.num_swapped_out_blocks, num_swapped_in_blocks=swap.num_swapped_in_blocks,
            **tier)

    def memory_usage(self, seqs: list[tuple[int, int, int]], waiting_max_len: int | None = None) -> MemoryUsage:
        """Slots by category (see memory_usage.py) for the sequences (seq_id, computed tokens,
        final length). A block shared by several sequences is counted once, for the first.
        No external fragmentation: any free block can hold any token."""
        B = self.block_size
        usage = MemoryUsage()
        seen: set[int] = set()
        for seq_id, written, final_len in seqs:
            for i, block in enumerate(self.tables.get(seq_id, ())):
                if block.block_id not in seen:
                    seen.add(block.block_id)
                    usage.add_held(i * B, B, written, final_len)
        usage.free = self.pool.num_free_blocks * B
        return usage

    # ---- invariants (pagedserve/invariants.py calls these) ---------------------------------
    def check_invariants(self, live: dict[int, SeqState] | None = None, swapped: set[int] = frozenset()) -> None:
        """Invariants 1 and 3 (docs/architecture.md), in both pools, plus the free queues and the prefix-cache
        index; with `live` and `swapped`, who may hold blocks and that computed tokens have slots."""
        host_tables = self.swap.tables
        tier_held = self.tier.held() if self.tier is not None else []   # loads in flight, waiting requests' pins
        for pool, tables, more in ((self.pool, self.tables, tier_held), (self.swap.pool, host_tables, [])):
            holders = Counter(b.block_id for t in (*tables.values(), *more) for b in t)
            for t in tables.values():
                assert len({b.block_id for b in t}) == len(t), "a block appears twice in one table"
                assert all(pool.blocks[b.block_id] is b for b in t), "a table holds a block of the other pool"
            for block in pool.blocks:
                assert block.ref_cnt == holders[block.block_id], (
                    f"block {block.block_id}: ref_cnt {block.ref_cnt} != {holders[block.block_id]} tables")
                assert (block.ref_cnt == 0) == (block.block_id in pool.free_queue), (
                    f"block {block.block_id}: ref_cnt {block.ref_cnt} but free-queue membership wrong")
        for key, block in self.pool.cached.items():
            assert block.key == key, f"cache index points at block {block.block_id} with another key"
        assert not self.swap.pool.cached, "host blocks are never in the prefix cache"
        assert not set(self.tables) & set(host_tables), "a sequence is both on the device and swapped"
        assert set(self.keys) == set(self.salts) == set(self.tables) | set(host_tables)
        self._check_prefix_index(host_tables)
        if live is not None:
            self._check_tables(live)
            self._check_swapped(set(swapped), host_tables)
        assert self.num_logical_blocks == sum(len(t) for t in self.tables.values()), "logical block count drifted"

    def _check_prefix_index(self, host_tables: dict) -> None:
        """The prefix-cache index and the blocks agree, and each table's keys match its blocks."""
        pool = self.pool
        assert all(pool.blocks[i] is b for i, b in pool.free_queue.items()), "free queue entry under a wrong id"
        for block in pool.blocks:
            assert block.key is None or pool.cached.get(block.key) is block, (
                f"block {block.block_id} has a prefix key but the cache index does not point at it")
        assert self.enable_caching or not pool.cached, "blocks cached with prefix caching off"
        for seq_id, keys in self.keys.items():
            table = self.tables.get(seq_id) or host_tables.get(seq_id, [])
            assert len(keys) <= len(table), f"sequence {seq_id}: more prefix keys than blocks"
            for block, key in zip(table, keys):
                assert block.key in (None, key), (
                    f"sequence {seq_id}: block {block.block_id} is cached under another prefix")

    def _check_tables(self, live: dict[int, SeqState]) -> None:
        """Only live sequences of running requests hold device blocks (so a finished, aborted or
        recompute-preempted request holds none); computed tokens have slots; prefix-cache keys
        are those of the sequence's tokens and its request's cache salt."""
        B = self.block_size
        stray = set(self.tables) - set(live)
        assert not stray, f"sequences {sorted(stray)} hold blocks but are not live in a running request"
        for seq_id, seq in live.items():
            table = self.tables.get(seq_id, ())
            slots = len(seq.token_ids) + seq.num_draft_slots    # drafts: slots past the tokens, this step
            assert cdiv(seq.num_computed_tokens, B) <= len(table) <= cdiv(slots, B), (
                f"sequence {seq_id}: {len(table)} blocks for {seq.num_computed_tokens} computed of "
                f"{len(seq.token_ids)} tokens")
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
        """The step about to run writes only blocks its sequence alone holds.

        One exception is safe and expected: a block registered in the prefix cache while this
        step fills it (by its writes, after a copy-on-write copy) may be picked up by a request
        admitted later in the same step. Every holder then expects exactly the tokens being
        written (they share the block's key), and each layer writes the whole batch's keys and
        values before attending.
        """
        B = self.block_size
        written: set[int] = set()
        for w in writes:
            table = self.tables.get(w.seq_id, [])
            assert w.block_ids == [b.block_id for b in table], f"sequence {w.seq_id}: stale block table in the step"
            assert len(table) >= cdiv(w.start + w.num_new_tokens, B), f"sequence {w.seq_id}: no slot for its tokens"
            for i in range(w.start // B, (w.start + w.num_new_tokens - 1) // B + 1):
                block = table[i]
                written.add(block.block_id)
                if block.ref_cnt > 1:
                    holders = [sid for sid, t in self.tables.items() if i < len(t) and t[i] is block]
                    assert block.key is not None and len(holders) == block.ref_cnt and all(
                        i < len(self.keys[h]) and self.keys[h][i] == block.key for h in holders), (
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
