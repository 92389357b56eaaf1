"""Swap space (preemption_mode="swap"): a second block pool, in host memory, with tables of its own.

Swapping a group of sequences out moves their block tables here, one host block per
distinct device block, so the group's sharing survives the trip; swapping in moves them
back. It reaches the device tables of the paged manager that owns it only through the
manager's swap calls (`device_tables`, `release_tables`, `restore_tables`). Ids only: the
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
        device = self.device.device_tables(seq_ids)
        return len({id(b) for sid in seq_ids for b in device.get(sid, self.tables.get(sid, ()))})

    def can_swap_out(self, seq_ids: list[int]) -> bool:
        return self.num_blocks_to_swap(seq_ids) <= self.pool.num_free_blocks

    def swap_out(self, seq_ids: list[int]) -> list[BlockCopy]:
        """Move the sequences' tables to swap space; returns the (device, host) block copies
        the worker must do before this step's forward (the device blocks are free from now,
        and a cached one stays findable by its key). Check `can_swap_out` first."""
        device = self.device.device_tables(seq_ids)
        host, moved = mirror_tables(device, self.pool)
        self.device.release_tables(list(device))
        self.tables.update(host)
        self.num_swapped_out_blocks += len(moved)
        return moved

    def swap_in(self, seq_ids: list[int]) -> list[BlockCopy]:
        """Move swapped-out tables back to device blocks; returns the (host, device) copies
        to do before the step's forward. Needs `num_blocks_to_swap` free device blocks."""
        host = {sid: self.tables[sid] for sid in seq_ids if sid in self.tables}
        moved = self.device.restore_tables(host)
        for sid in host:
            self.pool.release(self.tables.pop(sid)[::-1])
        self.num_swapped_in_blocks += len(moved)
        return moved

    def free(self, seq_id: int) -> None:
        self.pool.release(self.tables.pop(seq_id, []))

    def snapshot(self) -> PoolSnapshot | None:
        """The host blocks' reference counts and the swapped-out tables (None: no swap space)."""
        return snapshot_pool(self.pool.blocks, self.tables, with_keys=False) if self.num_blocks else None


def mirror_tables(tables: dict[int, list[KVBlock]],
                  pool: BlockPool) -> tuple[dict[int, list[KVBlock]], list[BlockCopy]]:
    """Give each sequence a table in `pool` mirroring its table in `tables`: one new block per
    distinct source block, shared by the same sequences as before. Returns the new tables and
    the (source, new) block copies; allocates nothing if the pool is short (NoFreeBlocksError)."""
    distinct = {b.block_id for table in tables.values() for b in table}
    if len(distinct) > pool.num_free_blocks:
        raise NoFreeBlocksError(f"moving {len(distinct)} blocks, {pool.num_free_blocks} free")
    new: dict[int, KVBlock] = {}
    mirrored: dict[int, list[KVBlock]] = {}
    for sid, src in tables.items():
        dst = []
        for block in src:
            if block.block_id in new:
                pool.touch([new[block.block_id]])
            else:
                (new[block.block_id],) = pool.allocate(1)
            dst.append(new[block.block_id])
        mirrored[sid] = dst
    return mirrored, [(src_id, block.block_id) for src_id, block in new.items()]
