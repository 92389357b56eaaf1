"""The prefix cache's host-memory tier, worker side: evicted KV blocks kept in slots of host
memory (pinned on a GPU, so copies run asynchronously on the device's stream), above the disk
tier (worker/kv_tier.py) or alone (`kv_offload_cpu_gb`; kv/tier.py decides which keys).

The engine sees one tier: its index holds the keys of the lowest tier there is (the disk's, or
the host's alone), and this store decides where a key's bytes are. A save copies the block into a
host slot (least recently used slots are reused) and, with a disk below, hands the slot to the
disk's writer thread as well (written through: the disk holds every key, the host the recent
ones), the slot kept from reuse until its file is written. A load found in a slot is copied into
its block at once (a copy on the device's stream orders before the step's forward), one not there
is read from the disk, and a block read from the disk takes a slot too (a restarted engine's
reads end up in host memory). Without a disk, a slot reused for another key loses its key: the
report says so and the engine's index forgets it.

On a CPU device the same store is a RAM tier above the disk: a hit costs one memory copy instead
of a file's read and checksum. Tests run it there (tests/test_kv_host_tier.py), and on CUDA.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Collection

import torch

from pagedserve.batch import TierReport
from pagedserve.worker.kv_tier import KVTierStore, block_view


class HostTierStore:
    def __init__(self, kv_cache: torch.Tensor, slots: int, below: KVTierStore | None) -> None:
        """kv_cache: the runner's [layers, 2, blocks, ...] cache; slots: host blocks; below: the
        disk tier, if any. On a CUDA cache the slots are pinned memory."""
        self.blocks, _ = block_view(kv_cache)
        self.below = below
        self.cuda = self.blocks.device.type == "cuda"
        shape = (self.blocks.shape[0], self.blocks.shape[1], *self.blocks.shape[3:])
        self.slots = torch.empty((slots, *shape), dtype=self.blocks.dtype, pin_memory=self.cuda)
        self.payload_bytes = self.slots[0].numel() * self.slots.element_size() if slots else 0
        # The engine's index holds the disk's keys when there is one (the host caches some of them).
        self.capacity = below.capacity if below is not None else slots
        self.where: OrderedDict[bytes, int] = OrderedDict()   # key -> slot, least recently used first
        self._free = list(range(slots - 1, -1, -1))
        self._writing: dict[int, int] = {}      # slot -> its writes in flight (not reused meanwhile)
        self._orphans: set[int] = set()         # slots whose key went while a write of theirs was in flight
        self._lock = threading.Lock()           # _free, _writing, _orphans: the writer thread frees slots
        self._landed: list[bytes] = []          # host hits copied into their blocks, for the next report
        self._failed: list[bytes] = []          # loads of keys no tier holds (host only)
        self._lost: list[bytes] = []            # keys whose slot went to another key (host only)
        self._from_disk: dict[bytes, int] = {}  # disk reads in flight: key -> block id (promoted on landing)
        self._pending_slots: dict[bytes, list[int]] = {}   # keys on their way to the disk: their slots
        self.host_loads = 0                     # loads served from host memory
        self.bytes_read_host = 0

    @property
    def writable(self) -> bool:
        return self.below.writable if self.below is not None else True

    def scan(self) -> list[bytes]:
        return self.below.scan() if self.below is not None else []

    # ---- slots ---------------------------------------------------------------------------
    def _slot(self) -> int | None:
        """A free slot, else the least recently used one not being written (its key leaves the
        host: lost without a disk below); None if every slot is being written."""
        with self._lock:
            if self._free:
                return self._free.pop()
            for key, slot in self.where.items():
                if slot not in self._writing:
                    break
            else:
                return None
        del self.where[key]
        if self.below is None:
            self._lost.append(key)
        return slot

    def _put(self, key: bytes, source: torch.Tensor) -> int | None:
        """Copy one block (a view of the cache) into a slot under `key`; None if no slot is free."""
        slot = self._slot()
        if slot is not None:
            self.slots[slot].copy_(source, non_blocking=self.cuda)
            self.where[key] = slot
        return slot

    def _drop(self, key: bytes) -> None:
        slot = self.where.pop(key, None)
        if slot is None:
            return
        with self._lock:
            if slot in self._writing:
                self._orphans.add(slot)
            else:
                self._free.append(slot)

    def _written(self, key: bytes) -> None:
        """The disk's writer thread filed a slot's bytes: the slot may be reused."""
        with self._lock:
            for slot in self._pending_slots.pop(key, ()):
                self._writing[slot] -= 1
                if not self._writing[slot]:
                    del self._writing[slot]
                    if slot in self._orphans:
                        self._orphans.discard(slot)
                        self._free.append(slot)

    # ---- the step's calls (the runner's, as KVTierStore's) -----------------------------------
    def save(self, items: list[tuple[int, bytes]]) -> None:
        """Copy these blocks into host slots now (the step may overwrite them); with a disk below,
        file them too. Blocks that find no slot go to the disk directly (or are lost)."""
        filed, direct = [], []
        for block_id, key in items:
            if key in self.where:                       # the same content, still here
                self.where.move_to_end(key)
                if self.below is not None:
                    direct.append((block_id, key))
                continue
            slot = self._put(key, self.blocks[:, :, block_id])
            if slot is not None:
                filed.append((key, slot))
            elif self.below is not None:
                direct.append((block_id, key))
            else:
                self._lost.append(key)
        if self.below is None:
            return
        if filed:
            ready = None
            if self.cuda:
                ready = torch.cuda.Event()
                ready.record()
            with self._lock:
                for key, slot in filed:
                    self._writing[slot] = self._writing.get(slot, 0) + 1
                    self._pending_slots.setdefault(key, []).append(slot)
            self.below.save_copies([(key, self.slots[slot]) for key, slot in filed], ready, self._written)
        self.below.save(direct)

    def delete(self, keys: list[bytes]) -> None:
        for key in keys:
            self._drop(key)
        if self.below is not None:
            self.below.delete(keys)

    def start_loads(self, items: list[tuple[bytes, int]]) -> None:
        """Host hits are copied into their blocks now (ordered before the next forward); the rest
        are read from the disk."""
        rest = []
        for key, block_id in items:
            slot = self.where.get(key)
            if slot is None:
                rest.append((key, block_id))
                continue
            self.where.move_to_end(key)
            self.blocks[:, :, block_id].copy_(self.slots[slot], non_blocking=self.cuda)
            self._landed.append(key)
            self.host_loads += 1
            self.bytes_read_host += self.payload_bytes
        if self.below is None:
            self._failed.extend(key for key, _ in rest)
        elif rest:
            self._from_disk.update(rest)
            self.below.start_loads(rest)

    def collect(self, wait: Collection[bytes] = ()) -> TierReport:
        report = self.below.collect(wait) if self.below is not None else TierReport()
        for key in report.loaded:                       # read from the disk: kept in a slot too
            block_id = self._from_disk.pop(key, None)
            if block_id is not None and key not in self.where:
                self._put(key, self.blocks[:, :, block_id])
        for key in report.failed:
            self._from_disk.pop(key, None)
        report.loaded = self._landed + report.loaded
        report.failed = self._failed + report.failed
        report.lost = self._lost + report.lost
        for key in report.lost:
            self._drop(key)
        self._landed, self._failed, self._lost = [], [], []
        report.host_blocks, report.host_loads = len(self.where), self.host_loads
        report.bytes_read += self.bytes_read_host
        return report

    def cancel(self) -> None:
        """The KV bookkeeping started afresh: the reads in flight mean nothing (host copies done
        already landed in blocks that are free now)."""
        if self.below is not None:
            self.below.cancel()
        self._landed, self._failed = [], []
        self._from_disk.clear()

    def flush(self) -> None:
        if self.below is not None:
            self.below.flush()

    def close(self) -> None:
        if self.below is not None:
            self.below.close()
