"""The prefix cache's second tier, engine side: which block keys a disk tier holds, and the
block moves between it and the pool.

A cached block the pool evicts is written to the tier once (`TierLink.evicted`: a save of
(block id, key) in the next StepBatch, before anything can overwrite the block); a prompt whose
prefix misses the pool but hits the tier gets blocks allocated and the tier's copies read into
them (`TierLink.fetch`: loads of (key, block id)), ahead of its admission: the request waits
for its loads, no step does. The worker's store (worker/kv_tier.py) does the file I/O and says
which loads landed (`finished`); a landed block enters the prefix cache under its key, and
the waiting request then finds it there like any other cached block. The request holds its
landed blocks until it is admitted (or leaves), so nothing evicts them meanwhile; a running
request short of blocks drops those holds before it preempts anyone (`drop_landed`).

Keys are the pool's own (kv/block_pool.py: the SHA-256 chain over tokens, salt, LoRA adapter and
KV format), but for a block that a step which was not batch-invariant computed (KVBlock.batch_invariant):
its tier key is the pool key with one byte more (`tier_key`), so a restarted engine still knows
which blocks a greedy request may read back, and the two copies of one prefix never overwrite
each other. The store files them under a fingerprint of the model, so another model never reads
them. Ids and keys only: no tensors, no files here.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedserve.kv.block_pool import BlockKey, BlockPool, KVBlock
from pagedserve.kv.events import KVEventSink

if TYPE_CHECKING:
    from pagedserve.batch import TierReport

_BATCH_DEPENDENT = b"\x01"      # a tier key's suffix for a block a batch-dependent step computed


def tier_key(key: BlockKey, batch_invariant: bool) -> BlockKey:
    """The tier's key of a pool block (its pool key, or with a suffix for a batch-dependent block)."""
    return key if batch_invariant else key + _BATCH_DEPENDENT


def pool_key(key: BlockKey) -> tuple[BlockKey, bool]:
    """The pool key of a tier key, and whether batch-invariant steps computed the block."""
    return (key[:-len(_BATCH_DEPENDENT)], False) if len(key) > 32 else (key, True)   # (pool keys: SHA-256)


@dataclass
class TierStats:
    """Cumulative counters (tokens for queries and hits, as the prefix cache's)."""
    queries: int = 0            # prompt tokens looked up in the tier (those past the pool's hits)
    hits: int = 0               # of those, tokens the tier held (loads issued or joined)
    blocks_saved: int = 0       # blocks sent to the tier
    blocks_loaded: int = 0      # blocks read back into the pool
    load_failures: int = 0      # loads the store refused (missing, corrupt, foreign): recomputed
    bytes_written: int = 0      # the store's totals, as last reported
    bytes_read: int = 0
    writable: bool = True       # False once a write failed (full disk): no more saves
    host_blocks: int = 0        # the host-memory tier (kv_offload_cpu_gb): blocks it holds
    host_loads: int = 0         # loads it served (no file read)


class TierIndex:
    """The keys the tier holds, least recently used first, at most `capacity` of them. Outlives
    the KV bookkeeping (LLMEngine.reset keeps it), since the files do."""

    def __init__(self, capacity: int, keys: Iterable[BlockKey] = (), events: KVEventSink | None = None) -> None:
        """events: told of every key that enters or leaves (a data-parallel router's index)."""
        self.capacity = capacity
        self.keys: OrderedDict[BlockKey, None] = OrderedDict()
        self.stats = TierStats()
        self.events = events
        self.evicted: list[BlockKey] = []       # keys over capacity, whose files go next
        for key in keys:        # oldest first (the store lists them by modification time)
            self.add(key)

    def __len__(self) -> int:
        return len(self.keys)

    def __contains__(self, key: BlockKey) -> bool:
        return key in self.keys

    def touch(self, key: BlockKey) -> None:
        self.keys.move_to_end(key)

    def add(self, key: BlockKey) -> None:
        if key not in self.keys and self.events is not None:
            self.events.tier_stored(key)
        self.keys[key] = None
        self._trim()

    def discard(self, key: BlockKey) -> None:
        if self.keys.pop(key, 0) is None and self.events is not None:
            self.events.tier_removed(key)

    def _trim(self) -> None:
        while len(self.keys) > self.capacity:
            key = self.keys.popitem(last=False)[0]
            self.evicted.append(key)
            if self.events is not None:
                self.events.tier_removed(key)


@dataclass(eq=False)
class Fetch:
    """One waiting request's reads: the blocks it holds (its pool hits, and each block a load of
    its lands in) and the keys it awaits. Held while the reads are in flight and, once all have
    landed, until the request is admitted or leaves (`release`), so that nothing evicts them before
    it takes them; a landed hold gives way to any allocation that would otherwise fail
    (`drop_landed`: it never keeps a running request from its blocks, the scheduler's liveness)."""
    blocks: list[KVBlock] = field(default_factory=list)
    keys: list[BlockKey] = field(default_factory=list)
    more: int = 0        # blocks its admission takes beyond these (the read-ahead's bound counts them)
    landed: bool = False     # every read is in: held for its admission


class TierLink:
    """The paged manager's collaborator for the tier (as SwapSpace is for swap space): it hears
    the pool's evictions, starts and finishes loads, and hands the worker's moves to the batch."""

    def __init__(self, pool: BlockPool, index: TierIndex) -> None:
        self.pool = pool
        self.index = index
        self.saves: list[tuple[int, BlockKey]] = []       # for the next batch: (block id, tier key)
        self.loads: list[tuple[BlockKey, int]] = []       # (tier key, block id)
        self.loading: dict[BlockKey, KVBlock] = {}        # loads in flight, by tier key; each holds its block once
        self.fetches: dict[str, Fetch] = {}               # by request id
        pool.on_evict = self.evicted

    # ---- saves ---------------------------------------------------------------------------
    def evicted(self, block: KVBlock) -> None:
        """The pool is about to reuse a cached block: save it unless the tier has its key (the
        same content; reading it back does not write it again)."""
        key = tier_key(block.key, block.batch_invariant)
        if key in self.index:
            self.index.touch(key)
        elif self.index.stats.writable:
            self.index.add(key)
            self.saves.append((block.block_id, key))
            self.index.stats.blocks_saved += 1

    def save_cached(self) -> None:
        """Save every cached block the tier lacks (the engine is stopping: a restart finds them)."""
        for key, block in self.pool.cached.items():
            if tier_key(key, block.batch_invariant) not in self.index and self.index.stats.writable:
                self.evicted(block)

    # ---- loads ---------------------------------------------------------------------------
    def fetch(self, owner: str, keys: list[BlockKey], blocks_needed: int, reserve: int, block_size: int,
              count: bool = True, partial: tuple[int, BlockKey] | None = None,
              invariant_only: bool = False) -> bool:
        """Start reading the longest run of `keys` (a prompt's lookup keys) that the tier holds
        past the pool's hits, if the request's admission would then leave `reserve` blocks free
        (it needs `blocks_needed` in all; the admission watermark while others run). Returns
        whether it has loads to wait for (`waiting` until they have landed). `count`: the
        request's first look, counted in queries and hits (tokens the tier holds, in tokens).
        partial: (its index, its key) of a partial block after the keys the pool and tier hold
        (kv_cache_manager's partial blocks): read too (or pinned, in the pool) where the run
        reaches it. invariant_only: blocks batch-invariant steps computed only (a greedy
        request's, as the pool's lookup)."""
        pool = self.pool
        hits = []
        for key in keys:
            block = pool.lookup(key, invariant_only)
            if block is None:
                break
            hits.append(block)
        wanted = []                       # the run of keys past the pool's hits that the tier has
        for key in keys[len(hits):]:
            found = self.tier_source(key, invariant_only)
            if found is None:
                break
            wanted.append(found)
        if count:
            self.index.stats.queries += (len(keys) - len(hits)) * block_size
            self.index.stats.hits += len(wanted) * block_size
        pinned = list(hits)
        if partial is not None and partial[0] == len(hits) + len(wanted):
            found = self.source(partial[1], invariant_only)
            if isinstance(found, KVBlock):
                pinned.append(found)
            elif found is not None:
                wanted.append(found)
        return self.start(owner, pinned, wanted, blocks_needed - len(pinned), reserve)

    def available(self, key: BlockKey) -> bool:
        """The tier holds the tier key, or is reading it."""
        return key in self.index or key in self.loading

    def tier_source(self, key: BlockKey, invariant_only: bool = False) -> BlockKey | None:
        """The tier key to read for a pool key: its batch-invariant copy, else (unless
        invariant_only) its batch-dependent one; None where the tier has neither."""
        for batch_invariant in (True, False)[:1 if invariant_only else 2]:
            if self.available(tier_key(key, batch_invariant)):
                return tier_key(key, batch_invariant)
        return None

    def source(self, key: BlockKey, invariant_only: bool = False) -> KVBlock | BlockKey | None:
        """Where a pool key's block comes from: the pool's cached block, else the tier key to read."""
        return self.pool.lookup(key, invariant_only) or self.tier_source(key, invariant_only)

    def reading(self, key: BlockKey) -> bool:
        """Some copy of the pool key's block is being read."""
        return any(tier_key(key, b) in self.loading for b in (True, False))

    def start(self, owner: str, hits: list[KVBlock], wanted: list[BlockKey], new_blocks: int, reserve: int) -> bool:
        """Pin the request's pool hits and read `wanted` (tier keys) into new blocks, if its
        admission (`new_blocks` beyond its hits, the reads' included) would leave `reserve` free."""
        pool = self.pool
        free = pool.num_free_blocks - sum(1 for b in hits if b.ref_cnt == 0)
        new = sum(k not in self.loading for k in wanted)   # reads another request started hold their blocks
        if not wanted or free - (new_blocks - (len(wanted) - new)) < reserve:
            return False                  # nothing to read, or its admission would not pass
        self.release(owner)              # (a hold dropped and read again: not left behind)
        fetch = self.fetches[owner] = Fetch(more=new_blocks - len(wanted))
        pool.touch(hits)                 # pinned first: allocating below may evict free cached blocks
        fetch.blocks.extend(hits)
        for key in wanted:               # the most recent keys first: the evictions' saves trim the oldest
            if key in self.index:
                self.index.touch(key)
        fresh = pool.allocate(new)
        for key in wanted:
            if key not in self.loading:  # (a key trimmed meanwhile by a small index fails its read: recomputed)
                block = self.loading[key] = fresh.pop()
                self.loads.append((key, block.block_id))
            pool.touch([self.loading[key]])
            fetch.blocks.append(self.loading[key])
            fetch.keys.append(key)
        return True

    def waiting(self, owner: str) -> bool:
        """Some read of the request is still in flight."""
        fetch = self.fetches.get(owner)
        return fetch is not None and not fetch.landed

    def holds(self, owner: str) -> bool:
        """The request holds blocks for its admission (reads in flight, or landed)."""
        return owner in self.fetches

    def reserved(self) -> int:
        """Blocks the requests with reads in flight take at admission beyond those they hold."""
        return sum(f.more for f in self.fetches.values())

    def awaited(self, owners: Iterable[str]) -> list[BlockKey]:
        """What a step that runs nothing waits for: the reads in flight of the first of `owners`
        (the waiting queue, in order) that has any, else every read in flight. Not all of them:
        the requests behind read ahead while the first is admitted and computes."""
        for owner in owners:
            if self.waiting(owner):
                return [k for k in self.fetches[owner].keys if k in self.loading]
        return list(self.loading)

    def release(self, owner: str) -> None:
        """Drop the request's holds (it was admitted: its tables hold the blocks now; or it left)."""
        fetch = self.fetches.pop(owner, None)
        if fetch is not None:
            self.pool.release(fetch.blocks[::-1])

    def lend(self, owner: str) -> Fetch | None:
        """Let go of the request's landed hold for its admission (whose lookup takes over a cached
        partial block only while it is free); `keep` takes it back if the admission fails."""
        fetch = self.fetches.get(owner)
        if fetch is None or not fetch.landed:
            return None
        self.release(owner)
        return fetch

    def keep(self, owner: str, fetch: Fetch) -> None:
        """Hold a lent fetch's blocks again (those still cached: a partial block taken over and
        let go is cached again, or free)."""
        fetch.blocks = [b for b in fetch.blocks if b.key is not None]
        self.pool.touch(fetch.blocks)
        self.fetches[owner] = fetch

    def drop_landed(self, keep: str | None = None) -> bool:
        """Drop every landed hold but `keep`'s (an allocation would fail without their blocks: a
        running request's growth, a swap-in, or the admission of a request ahead of them). Their
        blocks stay cached, free; returns whether any hold was dropped."""
        owners = [o for o, f in self.fetches.items() if f.landed and o != keep]
        for owner in owners:
            self.release(owner)
        return bool(owners)

    def finished(self, loaded: list[BlockKey], failed: list[BlockKey]) -> None:
        """The worker's answer: loads that landed enter the prefix cache; failed ones (the file
        missing, corrupt or foreign) leave the index, and their prefix is computed again."""
        stats = self.index.stats
        for key in loaded:
            block = self.loading.pop(key)
            key, block.batch_invariant = pool_key(key)
            self.pool.cache(block, key)
            self.pool.release([block])
            stats.blocks_loaded += 1
        for key in failed:
            block = self.loading.pop(key)
            self.index.discard(key)
            self.pool.release([block])
            stats.load_failures += 1
        for fetch in self.fetches.values():   # all its reads in: held until the request is admitted
            if not fetch.landed and not any(k in self.loading for k in fetch.keys):
                fetch.landed = True
                self._unhold_uncached(fetch)

    def _unhold_uncached(self, fetch: Fetch) -> None:
        """A landed fetch keeps only blocks the prefix cache finds (not a failed read's, nor a copy
        whose key another block already holds)."""
        lost = [b for b in fetch.blocks if b.key is None]
        fetch.blocks = [b for b in fetch.blocks if b.key is not None]
        self.pool.release(lost)

    def apply(self, report: TierReport) -> None:
        """The worker's news: landed reads enter the prefix cache, failed ones and lost files leave
        the index, the store's totals are taken."""
        self.finished(report.loaded, report.failed)
        self.forget(report.lost)
        stats = self.index.stats
        stats.bytes_written, stats.bytes_read = report.bytes_written, report.bytes_read
        stats.host_blocks, stats.host_loads = report.host_blocks, report.host_loads
        stats.writable = stats.writable and report.writable

    def forget(self, keys: list[BlockKey]) -> None:
        """Keys whose files are gone (a failed write, the directory's size bound)."""
        for key in keys:
            self.index.discard(key)

    # ---- the batch -----------------------------------------------------------------------
    def take(self) -> tuple[list[tuple[int, BlockKey]], list[tuple[BlockKey, int]], list[BlockKey]]:
        """This step's saves, loads and deletions (files past the index's capacity)."""
        out = self.saves, self.loads, self.index.evicted
        self.saves, self.loads, self.index.evicted = [], [], []
        return out

    def held(self) -> list[list[KVBlock]]:
        """The blocks the tier holds references to, as tables (for the invariant checker)."""
        return [list(self.loading.values()), *(f.blocks for f in self.fetches.values())]
