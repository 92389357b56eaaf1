"""Multi-LoRA serving: many PEFT adapters over one base model, mixed in one batch.

request.py: LoRARequest (what a request names). adapter.py: reading and checking a PEFT
adapter (front end) and loading its tensors (worker). slots.py: the scheduler's view of the
max_loras device slots (which adapter is in which, who uses it, LRU). weights.py: the worker's
stacked slot tensors, its host cache of max_cpu_loras adapters, and the per-step delta
B[slot] @ (A[slot] @ x) added to the rows of each adapter.
"""
from pagedserve.lora.request import LoRARequest

__all__ = ["LoRARequest"]
