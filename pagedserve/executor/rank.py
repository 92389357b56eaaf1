"""What a tensor-parallel rank other than the driver runs: load its shard, then run every
command the driver broadcasts until told to stop. Shared by the mp and ray backends."""
from __future__ import annotations

import torch

from pagedserve.config import EngineConfig
from pagedserve.distributed.group import TensorParallelGroup
from pagedserve.kernels.threads import available_cpus
from pagedserve.worker.device import resolve_device

# Commands the driver broadcasts: (kind, StepBatch or None).
EXECUTE, MOVE_BLOCKS, STOP = "execute", "move_blocks", "stop"


def threads_per_rank(config: EngineConfig) -> int:
    """config.threads_per_rank, or the CPUs this process may use (num_threads, else its
    affinity mask and cgroup quota) split evenly between the ranks."""
    if config.threads_per_rank:
        return config.threads_per_rank
    return max(1, (config.num_threads or available_cpus()) // config.tensor_parallel_size)


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """The configured device; on CUDA, the rank's own GPU among those this process sees."""
    device = resolve_device(config.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", rank % torch.cuda.device_count())
    return device


def run_rank(rank: int, config: EngineConfig, model_path: str, eos_token_ids: set[int], init_method: str) -> None:
    from pagedserve.worker.worker import Worker
    torch.set_num_threads(threads_per_rank(config))
    device = rank_device(config, rank)
    group = TensorParallelGroup(rank, config.tensor_parallel_size, init_method, device, config.distributed_timeout)
    worker = Worker.load(config, model_path, eos_token_ids, group, device)
    while True:
        kind, batch = group.broadcast()
        if kind == STOP:
            break
        if kind == EXECUTE:
            worker.runner.execute(batch)
        elif kind == MOVE_BLOCKS:
            worker.runner.move_blocks(batch)
    group.destroy()
