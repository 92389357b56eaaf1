"""Swap space (preemption_mode="swap"): a second block pool, in host memory, with tables of its own.

Swapping a group of sequences out moves their block tables (one per KV group, holes behind
a sliding window kept as holes) here, one host block per distinct device block, so the
group's sharing survives the trip; swapping in moves them back. It reaches the device tables of the paged manager that owns it only through the
manager's swap calls (`device_tables`, `release_tables`, `restore_tables`). Ids only: the
worker copies the blocks the returned (src, dst) lists name.
"""
from __future__ import annotations

from collections.abc import Hashable
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
        # Per KV group, swapped-out sequences' host tables; group 0's is `tables`.
        self.group_tables: list[dict[int, list[KVBlock | None]]] = [{} for _ in range(device.num_groups)]
        self.tables = self.group_tables[0]
        self.num_swapped_out_blocks = 0
        self.num_swapped_in_blocks = 0

    def num_blocks_to_swap(self, seq_ids: list[int]) -> int:
        """Distinct blocks the sequences hold, on the device or in swap space: what moving
        them as a group costs (shared blocks move once)."""
        groups = zip(self.device.device_tables(seq_ids), self.group_tables)
        return len({id(b) for device, host in groups for sid in seq_ids for b in device.get(sid, host.get(sid, ()))
                    if b is not None})

    def can_swap_out(self, seq_ids: list[int]) -> bool:
        return self.num_blocks_to_swap(seq_ids) <= self.pool.num_free_blocks

    def swap_out(self, seq_ids: list[int]) -> list[BlockCopy]:
        """Move the sequences' tables to swap space; returns the (device, host) block copies
        the worker must do before this step's forward (the device blocks are free from now,
        and a cached one stays findable by its key). Check `can_swap_out` first."""
        device = {(g, sid): t for g, tables in enumerate(self.device.device_tables(seq_ids)) for sid, t in tables.items()}
        host, moved = mirror_tables(device, self.pool)
        self.device.release_tables(seq_ids)
        for (g, sid), table in host.items():
            self.group_tables[g][sid] = table
        self.num_swapped_out_blocks += len(moved)
        return moved

    def swap_in(self, seq_ids: list[int]) -> list[BlockCopy]:
        """Move swapped-out tables back to device blocks; returns the (host, device) copies
        to do before the step's forward. Needs `num_blocks_to_swap` free device blocks."""
        host = [{sid: tables[sid] for sid in seq_ids if sid in tables} for tables in self.group_tables]
        moved = self.device.restore_tables(host)
        for g, tables in enumerate(host):
            for sid in tables:
                self.pool.release([b for b in self.group_tables[g].pop(sid)[::-1] if b is not None])
        self.num_swapped_in_blocks += len(moved)
        return moved

    def free(self, seq_id: int) -> None:
        for tables in self.group_tables:
            self.pool.release([b for b in tables.pop(seq_id, []) if b is not None])

    def snapshot(self) -> PoolSnapshot | None:
        """The host blocks' reference counts and the swapped-out tables (None: no swap space)."""
        if not self.num_blocks:
            return None
        tables = self.tables if len(self.group_tables) == 1 else {
            sid: [b for tables in self.group_tables for b in tables[sid] if b is not None] for sid in self.tables}
        return snapshot_pool(self.pool.blocks, tables, with_keys=False)


def mirror_tables(tables: dict[Hashable, list[KVBlock | None]],
                  pool: BlockPool) -> tuple[dict[Hashable, list[KVBlock | None]], list[BlockCopy]]:
    """Give each table in `tables` a table in `pool` mirroring it: one new block per distinct
    source block, shared by the same tables as before (holes stay holes). Returns the new tables
    and the (source, new) block copies; allocates nothing if the pool is short (NoFreeBlocksError)."""
    distinct = {b.block_id for table in tables.values() for b in table if b is not None}
    if len(distinct) > pool.num_free_blocks:
        raise NoFreeBlocksError(f"moving {len(distinct)} blocks, {pool.num_free_blocks} free")
    new: dict[int, KVBlock] = {}
    mirrored: dict[Hashable, list[KVBlock | None]] = {}
    for name, src in tables.items():
        dst: list[KVBlock | None] = []
        for block in src:
            if block is None:
                dst.append(None)
                continue
            if block.block_id in new:
                pool.touch([new[block.block_id]])
            else:
                (new[block.block_id],) = pool.allocate(1)
                new[block.block_id].batch_invariant = block.batch_invariant   # the same K and V
            dst.append(new[block.block_id])
        mirrored[name] = dst
    return mirrored, [(src_id, block.block_id) for src_id, block in new.items()]
