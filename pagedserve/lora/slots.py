"""The scheduler's view of the worker's LoRA slots: which adapter each of the max_loras slots
holds, how many admitted requests use it, and which to reuse first (least recently used).

A request holds its adapter's slot from admission until it finishes or is preempted by
recompute (a swapped-out request keeps it: it comes back before anything new is admitted).
So a running batch never has more than max_loras distinct adapters, and a slot is only
refilled once no request uses it. Putting an adapter in a slot is a LoRALoad in the next
batch (plain data: the worker reads the files, through its host cache).

A cold adapter (not in a slot, nor in the worker's host cache as far as these records go: the
last max_cpu_loras adapters loaded or read) is first read ahead: `request_read` puts a
LoRALoad with slot -1 in the next batch's lora_reads, the worker reads it in the background
during that step (lora/weights.py LoRAWeights.prefetch), and the request is admitted from
the next step on (the scheduler passes it over meanwhile, where other requests run), so no step
waits on the disk.
"""
from __future__ import annotations

from collections import OrderedDict

from pagedserve.batch import LoRALoad
from pagedserve.lora.request import LoRARequest


class LoRASlots:
    def __init__(self, max_loras: int, max_cpu_loras: int | None = None) -> None:
        self.max_loras = max_loras
        self.max_cpu_loras = max(max_cpu_loras or max_loras, max_loras)
        # An adapter is its (lora_int_id, lora_path): an id unloaded and given again with another
        # path is another adapter.
        self.slot_of: dict[tuple[int, str], int] = {}
        self.held: list[tuple[int, str] | None] = [None] * max_loras      # slot -> adapter
        self.users = [0] * max_loras
        self.recent: OrderedDict[int, None] = OrderedDict((s, None) for s in range(max_loras))  # LRU first
        self.pending: list[LoRALoad] = []                     # for the next batch
        self.reads: list[LoRALoad] = []                       # read-aheads for the next batch (slot -1)
        # The adapters the worker's host cache should hold (loaded or read ahead), LRU first.
        self.cached: OrderedDict[tuple[int, str], None] = OrderedDict()

    def can_acquire(self, lora: LoRARequest) -> bool:
        return _key(lora) in self.slot_of or self._free_slot() is not None

    def acquire(self, lora: LoRARequest) -> int:
        """The adapter's slot, filling a free one (least recently used first) if it is not there."""
        key = _key(lora)
        slot = self.slot_of.get(key)
        if slot is None:
            slot = self._free_slot()
            assert slot is not None, "acquire after can_acquire"
            old = self.held[slot]
            if old is not None:
                del self.slot_of[old]
            self.held[slot], self.slot_of[key] = key, slot
            self.pending.append(LoRALoad(slot, lora.lora_int_id, lora.lora_path))
            self._cached(key)
        self.users[slot] += 1
        self.recent.move_to_end(slot)
        return slot

    def release(self, slot: int) -> None:
        self.users[slot] -= 1
        assert self.users[slot] >= 0

    def forget(self, lora_int_id: int) -> None:
        """An unloaded adapter: its slot, if no one uses it, is free to refill at once."""
        for key, slot in list(self.slot_of.items()):
            if key[0] == lora_int_id and self.users[slot] == 0:
                del self.slot_of[key]
                self.held[slot] = None
                self.recent.move_to_end(slot, last=False)
        for key in [k for k in self.cached if k[0] == lora_int_id]:
            del self.cached[key]

    def take_loads(self) -> list[LoRALoad]:
        loads, self.pending = self.pending, []
        return loads

    def ready(self, lora: LoRARequest) -> bool:
        """Whether the adapter is in a slot or (as far as is known) in the worker's host cache."""
        key = _key(lora)
        return key in self.slot_of or key in self.cached

    def request_read(self, lora: LoRARequest) -> None:
        """Have the worker read a cold adapter into its host cache in the background (next batch)."""
        key = _key(lora)
        if not self.ready(lora) and all((r.lora_int_id, r.path) != key for r in self.reads):
            self.reads.append(LoRALoad(-1, lora.lora_int_id, lora.lora_path))

    def take_reads(self) -> list[LoRALoad]:
        reads, self.reads = self.reads, []
        for r in reads:
            self._cached((r.lora_int_id, r.path))
        return reads

    def _cached(self, key: tuple[int, str]) -> None:
        self.cached[key] = None
        self.cached.move_to_end(key)
        while len(self.cached) > self.max_cpu_loras:
            self.cached.popitem(last=False)

    def _free_slot(self) -> int | None:
        return next((s for s in self.recent if self.users[s] == 0), None)


def _key(lora: LoRARequest) -> tuple[int, str]:
    return lora.lora_int_id, lora.lora_path
