"""KV events: what entered and left a block pool's prefix cache, by block key, and the keys
the tier below it (kv/tier.py: disk, host memory) holds.

A data-parallel router keeps an exact index of every replica's cached blocks and tier keys from
these events (`KVIndex`, cluster/routing.py). The block pool and the tier's index call an optional
sink; with none set (the default) it costs one `is None` test per cached or evicted block.
"""
from __future__ import annotations

from collections import deque
from typing import Protocol

from pagedserve.kv.block_pool import BlockKey

# One event: ("stored", key), ("removed", key), or ("cleared", None) when a pool starts
# afresh (a new engine, or the KV bookkeeping reset after a failed step); the tier's
# ("tier_stored", key), ("tier_removed", key) (a reset keeps the tier: "cleared" is the pool's).
KVEvent = tuple[str, BlockKey | None]


class KVEventSink(Protocol):
    def stored(self, key: BlockKey) -> None: ...
    def removed(self, key: BlockKey) -> None: ...
    def cleared(self) -> None: ...
    def tier_stored(self, key: BlockKey) -> None: ...
    def tier_removed(self, key: BlockKey) -> None: ...


class KVEventLog:
    """A sink that keeps the events in order until someone drains them. The engine thread
    appends while another thread drains: a deque's append and popleft are thread-safe."""

    def __init__(self) -> None:
        self._events: deque[KVEvent] = deque()

    def stored(self, key: BlockKey) -> None:
        self._events.append(("stored", key))

    def removed(self, key: BlockKey) -> None:
        self._events.append(("removed", key))

    def cleared(self) -> None:
        self._events.append(("cleared", None))

    def tier_stored(self, key: BlockKey) -> None:
        self._events.append(("tier_stored", key))

    def tier_removed(self, key: BlockKey) -> None:
        self._events.append(("tier_removed", key))

    def drain(self) -> list[KVEvent]:
        out = []
        try:
            while True:
                out.append(self._events.popleft())
        except IndexError:
            return out
