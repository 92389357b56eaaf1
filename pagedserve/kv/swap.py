"""Swap space (preemption_mode="swap"): a second block pool, in host memory, with tables of its own.

Swapping a group of sequences out moves their block tables here, one host block per
distinct device block, so the group's sharing survives the trip; swapping in moves them
back. It works on the device tables of the paged manager that owns it. Ids only: the
worker copies the blocks the returned (src, dst) lists name.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from pagedserve.kv.block_pool import BlockPool, KVBlock, NoFreeBlocksError
from pagedserve.kv.interface import BlockCopy, PoolCapacity
from pagedserve.kv.snapshot import PoolSnapshot, snapshot_pool

if TYPE_CHECKING:
    from pagedserve.kv.kv_cache_manager import KVCacheManager


class SwapSpace(PoolCapacity):
    def __init__(self, device: KVCacheManager, num_host_blocks: int) -> None:
        self.device = device
        self.pool = BlockPool(num_host_blocks, enable_caching=False)
        self.tables: dict[int, list[KVBlock]] = {}     # swapped-out sequences' host blocks
        self.num_swapped_out_blocks = 0
        self.num_swapped_in_blocks = 0

    def num_blocks_to_swap(self, seq_ids: list[int]) -> int:
        """Distinct blocks the sequences hold, on the device or in swap space: what moving
        them as a group costs (shared blocks move once)."""
        tables = self.device.tables
        return len({id(b) for sid in seq_ids for b in tables.get(sid, self.tables.get(sid, ()))})

    def can_swap_out(self, seq_ids: list[int]) -> bool:
        return self.num_blocks_to_swap(seq_ids) <= self.pool.num_free_blocks

    def swap_out(self, seq_ids: list[int]) -> list[BlockCopy]:
        """Move the sequences' tables to swap space; returns the (device, host) block copies
        the worker must do before this step's forward (the device blocks are free from now,
        and a cached one stays findable by its key). Check `can_swap_out` first."""
        kv = self.device
        num_entries = sum(len(kv.tables.get(sid, ())) for sid in seq_ids)
        moved = _move(seq_ids, kv.tables, self.tables, kv.pool, self.pool)
        kv.num_logical_blocks -= num_entries
        self.num_swapped_out_blocks += len(moved)
        return moved

    def swap_in(self, seq_ids: list[int]) -> list[BlockCopy]:
        """Move swapped-out tables back to device blocks; returns the (host, device) copies
        to do before the step's forward. Needs `num_blocks_to_swap` free device blocks."""
        kv = self.device
        moved = _move(seq_ids, self.tables, kv.tables, self.pool, kv.pool)
        for sid in seq_ids:   # the new blocks hold the same full blocks: cache them again
            table = kv.tables.get(sid, ())
            kv.num_logical_blocks += len(table)
            for block, key in zip(table, kv.keys.get(sid, ())):
                kv.pool.cache(block, key)
        self.num_swapped_in_blocks += len(moved)
        return moved

    def free(self, seq_id: int) -> None:
        self.pool.release(self.tables.pop(seq_id, []))

    def snapshot(self) -> PoolSnapshot | None:
        """The host blocks' reference counts and the swapped-out tables (None: no swap space)."""
        return snapshot_pool(self.pool.blocks, self.tables, with_keys=False) if self.num_blocks else None


def _move(seq_ids: list[int], src_tables: dict, dst_tables: dict, src_pool: BlockPool,
          dst_pool: BlockPool) -> list[BlockCopy]:
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
