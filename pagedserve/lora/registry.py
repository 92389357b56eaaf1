"""The engine's record of the adapters it has checked: a LoRARequest is checked once (its
config and tensor shapes against the base model, lora/adapter.py) and then carried by its
requests with lora_path resolved to the local directory the worker reads."""
from __future__ import annotations

import dataclasses

from pagedserve.lora.adapter import LoRAAdapterError, read_adapter
from pagedserve.lora.request import LoRARequest


class LoRARegistry:
    def __init__(self, args, max_lora_rank: int) -> None:
        self.args, self.max_lora_rank = args, max_lora_rank
        self.checked: dict[int, tuple[LoRARequest, LoRARequest]] = {}   # int id -> (as given, resolved)

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
        resolved = dataclasses.replace(lora, lora_path=spec.path)
        self.checked[lora.lora_int_id] = (lora, resolved)
        return resolved

    def remove(self, lora_int_id: int) -> bool:
        return self.checked.pop(lora_int_id, None) is not None
