"""A read-only copy of the KV cache's state, for the live dashboard and `LLM.kv_snapshot()`.

Taken on the thread that owns the KV cache (the engine thread), between steps, so it
sees one consistent state and needs no lock on the hot path. Taking it only copies
flat lists (each block's reference count and prefix-cache key, each table's block
ids); everything slower (block states, owners, hash prefixes, token text, JSON) is
derived from the copy afterwards, on another thread (engine/kv_view.py).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from operator import attrgetter

from pagedserve.kv.block_pool import BlockKey, KVBlock

_ref_cnt = attrgetter("ref_cnt")
_key = attrgetter("key")
_block_id = attrgetter("block_id")


@dataclass(frozen=True)
class PoolSnapshot:
    """One block pool: per block (by id) its reference count and prefix-cache key (None:
    not cached), and the block tables that point into it (seq_id -> block ids in logical order)."""
    ref_cnts: list[int]
    keys: list[BlockKey | None]
    tables: dict[int, list[int]]

    @property
    def num_blocks(self) -> int:
        return len(self.ref_cnts)


@dataclass(frozen=True)
class KVSnapshot:
    block_size: int
    device: PoolSnapshot
    host: PoolSnapshot | None = None                       # swap space, where there is one
    # Token ids of cached blocks by key (what the prefix cache remembers; may hold keys no
    # longer cached: look up only the keys in `device.keys`).
    cached_tokens: Mapping[BlockKey, tuple[int, ...] | None] = field(default_factory=dict)
    kv_allocator: str = "paged"
    # A hybrid model's device blocks held by a table: block id -> its KV group (kv/groups.py).
    group_of_block: dict[int, int] = field(default_factory=dict)


def snapshot_pool(blocks: list[KVBlock], tables: Mapping[int, list[KVBlock]], with_keys: bool = True) -> PoolSnapshot:
    """Copy what a pool's blocks and tables hold now (C-speed list builds: no per-block Python frame)."""
    keys = list(map(_key, blocks)) if with_keys else [None] * len(blocks)
    return PoolSnapshot(list(map(_ref_cnt, blocks)), keys,
                        {sid: list(map(_block_id, table)) for sid, table in tables.items()})
