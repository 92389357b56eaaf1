"""Which device the engine runs on, and how much KV cache memory it gets there."""
from __future__ import annotations

import torch

from pagedserve.config import DEFAULT_KV_CACHE_MEMORY


def resolve_device(name: str | None) -> torch.device:
    """None: the GPU when torch sees one, else the CPU."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={name!r} was asked for, but torch sees no CUDA GPU "
                         f"(torch {torch.__version__}); use device='cpu'")
    return device


def free_device_memory(device: torch.device) -> int | None:
    """Free bytes on a CUDA device (None on CPU)."""
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return free


def default_kv_cache_memory(device: torch.device, free_before_load: int | None, utilization: float) -> int:
    """Bytes of KV cache when kv_cache_memory is not given. On CUDA, like vLLM's
    gpu_memory_utilization: that share of the memory that was free before the weights
    were loaded, less what this process holds now (the weights); the rest is headroom
    for activations. On CPU, DEFAULT_KV_CACHE_MEMORY."""
    if device.type != "cuda":
        return DEFAULT_KV_CACHE_MEMORY
    held = torch.cuda.memory_allocated(device)
    budget = int(utilization * free_before_load) - held
    if budget <= 0:
        raise ValueError(f"no GPU memory left for the KV cache: {utilization:.0%} of the {free_before_load / 2**30:.1f} "
                         f"GiB that were free is less than the {held / 2**30:.1f} GiB the model holds; raise "
                         f"gpu_memory_utilization or pass kv_cache_memory")
    return budget
