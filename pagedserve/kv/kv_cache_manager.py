"""Block tables: the "page tables" of the paged KV cache.

One block table per sequence maps logical block i (token positions
[i*B, (i+1)*B)) to a physical block. Blocks are allocated only when a token
needs one, shared by reference count (fork), copied before a write into a
shared block (copy-on-write), and full blocks are registered in the prefix
cache so later sequences with the same prefix can reuse them.
Swap space (preemption_mode="swap") is a second block pool, in host memory, with
tables of its own: swapping a group of sequences out moves their tables there, one
host block per distinct device block, so the group's sharing survives the trip.
Pure Python: no tensors here.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from pagedserve.kv.block_pool import BlockKey, BlockPool, KVBlock, NoFreeBlocksError, prefix_block_keys
from pagedserve.kv.memory_usage import MemoryUsage


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PrefixCacheStats:
    queries: int = 0   # prompt tokens looked up
    hits: int = 0      # of those, tokens found in the cache


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 num_host_blocks: int = 0) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.tables: dict[int, list[KVBlock]] = {}
        self.keys: dict[int, list[BlockKey]] = {}   # keys of each sequence's full blocks (kept while swapped)
        self.salts: dict[int, str | None] = {}       # each sequence's cache salt (part of its first key)
        self.prefix_stats = PrefixCacheStats()
        # Swap space: host blocks and the tables of swapped-out sequences.
        self.host_pool = BlockPool(num_host_blocks, enable_caching=False)
        self.host_tables: dict[int, list[KVBlock]] = {}
        self.num_swapped_out_blocks = 0
        self.num_swapped_in_blocks = 0

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

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
        for key in prefix_block_keys(token_ids, self.block_size, (len(token_ids) - 1) // self.block_size,
                                     cache_salt):
            block = self.pool.lookup(key)
            if block is None:
                break
            hits.append(block)
        return hits

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

    # Hooks for allocators that reserve memory ahead (kv/contiguous.py); paging needs neither.
    def check_request(self, prompt_len: int, max_tokens: int, shares_blocks: bool) -> None:
        """Refuse a request this allocator cannot serve (the scheduler checks the block count)."""

    def set_max_len(self, seq_id: int, max_len: int) -> None:
        """At admission: the most tokens the sequence can reach. Paging reserves nothing ahead."""

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
        assert seq_id not in self.host_tables, f"sequence {seq_id} is swapped out: swap it in first"
        table = self.tables.setdefault(seq_id, [])
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
        # Invariant 2: a block with more than one reference is never written.
        assert not self._shared_write_targets(table, num_computed, num_new)
        self._cache_full_blocks(seq_id, token_ids, num_computed + num_new)
        return copies

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares every block of the parent (copy-on-write later)."""
        blocks = self.tables[parent_id]
        self.pool.touch(blocks)
        self.tables[child_id] = list(blocks)
        self.keys[child_id] = list(self.keys[parent_id])
        self.salts[child_id] = self.salts[parent_id]

    def free(self, seq_id: int) -> None:
        """Drop a sequence's table (on the device or in swap space). Tail blocks are released
        first so that, among cached blocks, a prefix's later blocks are evicted before its
        earlier ones."""
        table = self.tables.pop(seq_id, [])
        self.keys.pop(seq_id, None)
        self.salts.pop(seq_id, None)
        self.pool.release(table[::-1])
        self.host_pool.release(self.host_tables.pop(seq_id, []))

    # ---- swap space ------------------------------------------------------------------------
    @property
    def num_free_host_blocks(self) -> int:
        return self.host_pool.num_free_blocks

    def num_blocks_to_swap(self, seq_ids: list[int]) -> int:
        """Distinct blocks the sequences hold, on the device or in swap space: what moving
        them as a group costs (shared blocks move once)."""
        return len({id(b) for sid in seq_ids
                    for b in self.tables.get(sid, self.host_tables.get(sid, ()))})

    def can_swap_out(self, seq_ids: list[int]) -> bool:
        return self.num_blocks_to_swap(seq_ids) <= self.host_pool.num_free_blocks

    def swap_out(self, seq_ids: list[int]) -> list[tuple[int, int]]:
        """Move the sequences' tables to swap space; returns the (device, host) block copies
        the worker must do before this step's forward (the device blocks are free from now,
        and a cached one stays findable by its key). Check `can_swap_out` first."""
        moved = self._move(seq_ids, self.tables, self.host_tables, self.pool, self.host_pool)
        self.num_swapped_out_blocks += len(moved)
        return moved

    def swap_in(self, seq_ids: list[int]) -> list[tuple[int, int]]:
        """Move swapped-out tables back to device blocks; returns the (host, device) copies
        to do before the step's forward. Needs `num_blocks_to_swap` free device blocks."""
        moved = self._move(seq_ids, self.host_tables, self.tables, self.host_pool, self.pool)
        for sid in seq_ids:   # the new blocks hold the same full blocks: cache them again
            for block, key in zip(self.tables.get(sid, ()), self.keys.get(sid, ())):
                self.pool.cache(block, key)
        self.num_swapped_in_blocks += len(moved)
        return moved

    @staticmethod
    def _move(seq_ids: list[int], src_tables: dict, dst_tables: dict, src_pool: BlockPool,
              dst_pool: BlockPool) -> list[tuple[int, int]]:
        """Give each sequence a table in `dst_pool` mirroring its table in `src_pool`: one new
        block per distinct source block, shared by the same sequences as before."""
        seq_ids = [sid for sid in seq_ids if sid in src_tables]
        distinct = {b.block_id for sid in seq_ids for b in src_tables[sid]}
        if len(distinct) > dst_pool.num_free_blocks:
            raise NoFreeBlocksError(f"moving {len(distinct)} blocks, {dst_pool.num_free_blocks} free")
        new: dict[int, KVBlock] = {}
        for sid in seq_ids:
            src = src_tables.pop(sid)
            dst = []
            for block in src:
                if block.block_id in new:
                    dst_pool.touch([new[block.block_id]])
                else:
                    (new[block.block_id],) = dst_pool.allocate(1)
                dst.append(new[block.block_id])
            src_pool.release(src[::-1])
            dst_tables[sid] = dst
        return [(src_id, block.block_id) for src_id, block in new.items()]

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
                                     self.salts[seq_id], known=keys))
        for i, key in enumerate(new, start=len(keys)):
            self.pool.cache(table[i], key)
        keys.extend(new)

    # ---- accounting ------------------------------------------------------------------------
    def stats(self) -> dict:
        pool = self.pool
        logical = sum(len(t) for t in self.tables.values())
        physical = pool.num_blocks - pool.num_free_blocks
        return {
            "num_blocks": pool.num_blocks,
            "block_size": self.block_size,
            "num_free_blocks": pool.num_free_blocks,
            "num_used_blocks": physical,
            "usage": physical / max(1, pool.num_blocks),
            "num_cached_blocks": len(pool.cached),
            "num_evicted_blocks": pool.num_evictions,
            "prefix_cache_queries": self.prefix_stats.queries,
            "prefix_cache_hits": self.prefix_stats.hits,
            # Sharing as the paper measures it: blocks saved / blocks needed without sharing.
            "num_logical_blocks": logical,
            "sharing_saving": (logical - physical) / logical if logical else 0.0,
            "num_host_blocks": self.host_pool.num_blocks,
            "num_free_host_blocks": self.host_pool.num_free_blocks,
            "num_swapped_out_blocks": self.num_swapped_out_blocks,
            "num_swapped_in_blocks": self.num_swapped_in_blocks,
        }

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

    def check_invariants(self) -> None:
        """Invariants 1 and 3 of DESIGN.md, in both pools, plus the free queues and cache index."""
        for pool, tables in ((self.pool, self.tables), (self.host_pool, self.host_tables)):
            holders = Counter(b.block_id for t in tables.values() for b in t)
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
        assert not self.host_pool.cached, "host blocks are never in the prefix cache"
        assert not set(self.tables) & set(self.host_tables), "a sequence is both on the device and swapped"
        assert set(self.keys) == set(self.salts) == set(self.tables) | set(self.host_tables)
