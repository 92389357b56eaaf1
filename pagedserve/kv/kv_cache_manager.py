"""Block tables: the "page tables" of the paged KV cache.

One block table per sequence maps logical block i (token positions
[i*B, (i+1)*B)) to a physical block. Blocks are allocated only when a token
needs one, shared by reference count (fork), copied before a write into a
shared block (copy-on-write), and full blocks are registered in the prefix
cache so later sequences with the same prefix can reuse them.
Pure Python: no tensors here.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from pagedserve.kv.block_pool import BlockKey, BlockPool, KVBlock, block_key
from pagedserve.kv.memory_usage import MemoryUsage


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PrefixCacheStats:
    queries: int = 0   # prompt tokens looked up
    hits: int = 0      # of those, tokens found in the cache


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.tables: dict[int, list[KVBlock]] = {}
        self.keys: dict[int, list[BlockKey]] = {}   # keys of each sequence's full blocks
        self.prefix_stats = PrefixCacheStats()

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def block_ids(self, seq_id: int) -> list[int]:
        return [b.block_id for b in self.tables.get(seq_id, ())]

    def num_held_blocks(self, seq_id: int) -> int:
        return len(self.tables.get(seq_id, ()))

    def lookup_prefix(self, token_ids: list[int]) -> list[KVBlock]:
        """The cached blocks of the longest cached prefix of token_ids.

        At most len-1 tokens are matched: the last token is always computed, since its
        logits are what the next token is sampled from.
        """
        if not self.enable_caching:
            return []
        hits: list[KVBlock] = []
        parent: BlockKey | None = None
        B = self.block_size
        for i in range((len(token_ids) - 1) // B):
            key = block_key(parent, tuple(token_ids[i * B:(i + 1) * B]))
            block = self.pool.lookup(key)
            if block is None:
                break
            hits.append(block)
            parent = key
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
                 prefix_blocks: list[KVBlock] = ()) -> list[tuple[int, int]]:
        """Make room for tokens [num_computed, num_computed + num_new) of a sequence.

        `prefix_blocks` (prefix-cache hits, only for a sequence with no table yet) are
        taken by reference first. Returns the (src, dst) block copies the worker must do
        before the step: copy-on-write for shared blocks this step writes into.
        Call `num_blocks_needed` first: this raises if the pool runs dry half way.
        """
        table = self.tables.setdefault(seq_id, [])
        keys = self.keys.setdefault(seq_id, [])
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

    def free(self, seq_id: int) -> None:
        """Drop a sequence's table. Tail blocks are released first so that, among cached
        blocks, a prefix's later blocks are evicted before its earlier ones."""
        table = self.tables.pop(seq_id, [])
        self.keys.pop(seq_id, None)
        self.pool.release(table[::-1])

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
        B = self.block_size
        for i in range(len(keys), num_tokens // B):
            key = block_key(keys[-1] if keys else None, tuple(token_ids[i * B:(i + 1) * B]))
            keys.append(key)
            self.pool.cache(table[i], key)

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
        """Invariants 1 and 3 of DESIGN.md, plus the free queue and cache index."""
        holders = Counter(b.block_id for t in self.tables.values() for b in t)
        for t in self.tables.values():
            assert len({b.block_id for b in t}) == len(t), "a block appears twice in one table"
        for block in self.pool.blocks:
            assert block.ref_cnt == holders[block.block_id], (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} != {holders[block.block_id]} tables")
            assert (block.ref_cnt == 0) == (block.block_id in self.pool.free_queue), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but free-queue membership wrong")
        for key, block in self.pool.cached.items():
            assert block.key == key, f"cache index points at block {block.block_id} with another key"
        assert set(self.keys) == set(self.tables)
