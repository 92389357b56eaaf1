"""Physical KV blocks: reference counts, an LRU free queue, and the prefix-cache index.

This is the "physical memory" of the paging system. It knows block ids and
counts, never tensors: the worker owns the memory the ids point into.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

# A full block's identity for prefix caching: (parent block's hash, its token ids).
# Chaining through the parent makes a key stand for the whole prefix up to the block.
BlockKey = tuple[int | None, tuple[int, ...]]


def block_key(parent: BlockKey | None, token_ids: tuple[int, ...]) -> BlockKey:
    return (None if parent is None else hash(parent), token_ids)


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    key: BlockKey | None = None      # set while the block is in the prefix cache


class NoFreeBlocksError(RuntimeError):
    pass


class BlockPool:
    """A fixed set of blocks. Free blocks sit in an LRU queue: the front is evicted first.

    A freed block that holds a cached prefix stays findable by its key until it is
    reused for something else, so a later request with the same prefix can take it back.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.enable_caching = enable_caching
        self.free_queue: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[BlockKey, KVBlock] = {}
        self.num_evictions = 0           # cached blocks reused for other content

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def allocate(self, n: int) -> list[KVBlock]:
        """Take n blocks off the front of the free queue (evicting their cached content)."""
        if n > len(self.free_queue):
            raise NoFreeBlocksError(f"asked for {n} blocks, {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            _, block = self.free_queue.popitem(last=False)
            if block.key is not None:
                self.num_evictions += 1
                self._uncache(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[KVBlock]) -> None:
        """Add a reference to each block (sharing, or a prefix-cache hit on a free block)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def release(self, blocks: list[KVBlock]) -> None:
        """Drop a reference from each block; blocks nobody holds go back to the free queue.

        Blocks with cached content go to the back (evicted last, least recently used first);
        blocks without it go to the front, since nothing is lost by reusing them.
        """
        for block in blocks:
            assert block.ref_cnt > 0, f"block {block.block_id} released more often than held"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block
                if block.key is None:
                    self.free_queue.move_to_end(block.block_id, last=False)

    def lookup(self, key: BlockKey) -> KVBlock | None:
        return self.cached.get(key)

    def cache(self, block: KVBlock, key: BlockKey) -> None:
        """Register a full block under its key; if another block already holds the same
        content, that one stays the cached copy and this one stays private."""
        if not self.enable_caching or block.key is not None or key in self.cached:
            return
        block.key = key
        self.cached[key] = block

    def _uncache(self, block: KVBlock) -> None:
        if block.key is not None:
            del self.cached[block.key]
            block.key = None
