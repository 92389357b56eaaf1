"""The engine's record of the adapters it has checked: a LoRARequest is checked once (its
config and tensor shapes against the base model, lora/adapter.py) and then carried by its
requests with lora_path resolved to the local directory the worker reads."""
from __future__ import annotations

import dataclasses
from collections import Counter

from pagedserve.lora.adapter import LoRAAdapterError, adapter_fingerprint, read_adapter
from pagedserve.lora.request import LoRARequest


class LoRARegistry:
    def __init__(self, args, max_lora_rank: int) -> None:
        self.args, self.max_lora_rank = args, max_lora_rank
        self.checked: dict[int, tuple[LoRARequest, LoRARequest]] = {}   # int id -> (as given, resolved)
        self.failures: Counter = Counter()     # int id -> reads that failed in a step (forget)

    def check(self, lora: LoRARequest) -> LoRARequest:
        """The request's adapter, resolved and checked (LoRAAdapterError if it cannot be served)."""
        if not isinstance(lora, LoRARequest):
            raise LoRAAdapterError(f"lora_request must be a LoRARequest; got {type(lora).__name__}")
        known = self.checked.get(lora.lora_int_id)
        if known is not None:
            given, resolved = known
            if (given.lora_name, given.lora_path) != (lora.lora_name, lora.lora_path):
                raise LoRAAdapterError(f"lora_int_id {lora.lora_int_id} is already adapter {given.lora_name!r} "
                                       f"({given.lora_path}); each adapter needs its own id")
            return resolved
        spec = read_adapter(lora.lora_path, lora.lora_name, self.args, self.max_lora_rank)
        # Its prefix-cache key's content part; after a failed read (its blocks of that step hold
        # what another adapter computed) a new generation, so files put back as they were never
        # meet those blocks.
        fingerprint = adapter_fingerprint(spec.path) + (f"#{self.failures[lora.lora_int_id]}"
                                                        if self.failures[lora.lora_int_id] else "")
        resolved = dataclasses.replace(lora, lora_path=spec.path, fingerprint=fingerprint)
        self.checked[lora.lora_int_id] = (lora, resolved)
        return resolved

    def remove(self, lora_int_id: int) -> bool:
        return self.checked.pop(lora_int_id, None) is not None

    def forget_failed(self, lora_int_id: int) -> None:
        """An adapter the worker could not read in a step (its files changed): checked again,
        under a new cache key, at its next request."""
        self.failures[lora_int_id] += 1
        self.remove(lora_int_id)
