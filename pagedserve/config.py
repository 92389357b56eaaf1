"""Engine configuration: what to load, how much KV memory, how to batch."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# The choices of the settings below, defined once: EngineConfig checks them, the CLI offers them.
DTYPES = ("auto", *_DTYPES)
DEVICES = ("cpu", "cuda", "cuda:N")                      # cuda:N for any device index N
ATTENTION_BACKENDS = ("cpu", "torch", "triton")
CONTIGUOUS_POLICIES = ("max", "pow2", "oracle")        # kv/contiguous.py: the paper's baselines
KV_ALLOCATORS = ("paged", *CONTIGUOUS_POLICIES)
PREEMPTION_MODES = ("recompute", "swap")
DISTRIBUTED_EXECUTOR_BACKENDS = ("mp", "ray")           # executor/: processes on this machine, Ray actors


def _one_of(name: str, value, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


@dataclass
class EngineConfig:
    model: str | None = None            # HF directory, .gguf file, or None for the default model
    tokenizer: str | None = None        # defaults to the model's own
    dtype: str = "auto"                 # float32 | bfloat16 | float16 | auto
    seed: int = 0
    # KV cache
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes; None -> DEFAULT_KV_CACHE_MEMORY
    num_gpu_blocks_override: int | None = None  # exact number of blocks (tests, benchmarks)
    enable_prefix_caching: bool = True
    # paged, or a baseline that reserves one contiguous region per request (kv/contiguous.py):
    # max | pow2 | oracle. The baselines share nothing (no n > 1, beam search or prefix caching).
    kv_allocator: str = "paged"
    # Scheduler
    max_model_len: int | None = None    # defaults to the model's context length
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    preemption_mode: str = "recompute"  # recompute | swap
    # Watchdog: after this many steps in a row that compute nothing while requests wait (the
    # scheduler's liveness argument says none should), fail those requests; 0 turns it off.
    watchdog_steps: int = 100
    swap_space: int = 0                 # bytes of host memory for swapped-out blocks
    num_host_blocks_override: int | None = None  # exact number of swap-space blocks (tests, benchmarks)
    # Debugging: check the paging invariants after every step (costly; tests turn it on).
    check_invariants: bool = False
    # Device and attention kernels. None picks cuda + triton when torch sees a GPU, else cpu + cpu.
    device: str | None = None               # cpu | cuda | cuda:N
    attention_backend: str | None = None    # cpu (C++ kernel) | torch (reference) | triton
    gpu_memory_utilization: float = 0.9     # CUDA, kv_cache_memory unset: KV gets this share of free memory, less the weights
    # Tensor parallelism (executor/): the model's heads, MLP and vocabulary split over this many
    # ranks, each in its own process (rank 0 in the engine's), started by the backend: mp
    # (this machine) or ray (a Ray cluster). kv_cache_memory is per rank.
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None   # mp | ray; None: mp when tensor_parallel_size > 1
    threads_per_rank: int | None = None     # torch/OpenMP threads of each rank; None: the cores / tensor_parallel_size
    distributed_timeout: float = 120.0      # seconds a collective may wait for a rank before the engine fails

    def __post_init__(self) -> None:
        _one_of("dtype", self.dtype, DTYPES)
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # Every running sequence must be able to decode one token per step.
            self.max_num_batched_tokens = self.max_num_seqs
        if self.watchdog_steps < 0:
            raise ValueError(f"watchdog_steps must be >= 0 (0: off), got {self.watchdog_steps}")
        _one_of("preemption_mode", self.preemption_mode, PREEMPTION_MODES)
        _one_of("kv_allocator", self.kv_allocator, KV_ALLOCATORS)
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 bytes, got {self.swap_space}")
        if self.preemption_mode == "swap" and self.kv_allocator != "paged":
            raise ValueError(f"preemption_mode='swap' needs kv_allocator='paged' (swap space is a pool of "
                             f"blocks), not {self.kv_allocator!r}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")
        if self.device is not None and self.device != "cpu" and not self.device.startswith("cuda"):
            raise ValueError(f"device must be one of {', '.join(DEVICES)}; got {self.device!r}")
        if self.attention_backend is not None:
            _one_of("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.distributed_executor_backend is None and self.tensor_parallel_size > 1:
            self.distributed_executor_backend = "mp"
        if self.distributed_executor_backend is not None:
            _one_of("distributed_executor_backend", self.distributed_executor_backend, DISTRIBUTED_EXECUTOR_BACKENDS)
        if self.threads_per_rank is not None and self.threads_per_rank < 1:
            raise ValueError(f"threads_per_rank must be >= 1, got {self.threads_per_rank}")
        if self.distributed_timeout <= 0:
            raise ValueError(f"distributed_timeout must be > 0 seconds, got {self.distributed_timeout}")


DEFAULT_KV_CACHE_MEMORY = 2 * 1024**3


def resolve_dtype(name: str, model_default: torch.dtype | None, bf16_is_fast: bool = True) -> torch.dtype:
    """`auto` takes the checkpoint's dtype, with float16 turned into bfloat16 (CPUs have fast
    bf16 paths, not fp16), and bfloat16 into float32 where `bf16_is_fast` says the device
    has no fast bf16 matmul (kernels.cpu.auto_keeps_bf16 on CPU)."""
    if name != "auto":
        return _DTYPES[name]
    dtype = torch.bfloat16 if model_default in (None, torch.float16) else model_default
    return torch.float32 if dtype == torch.bfloat16 and not bf16_is_fast else dtype


def cache_dir(*parts: str) -> Path:
    """Where pagedserve keeps what it derives once per machine (converted weights,
    tokenizers, compiled kernels): $PAGEDSERVE_CACHE or ~/.cache/pagedserve."""
    root = Path(os.environ.get("PAGEDSERVE_CACHE", Path.home() / ".cache" / "pagedserve"))
    return root.joinpath(*parts)
