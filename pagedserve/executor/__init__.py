"""Executors: how the engine runs each step's batch on the model's workers.

`UniProcExecutor` (one process, the default) calls the worker in the engine's process;
`TensorParallelExecutor` runs the driver rank there and the other ranks in processes a
backend starts: `mp` (torch.multiprocessing on this machine) or `ray` (Ray actors, on
any machines of a Ray cluster)."""
from __future__ import annotations

from pagedserve.config import EngineConfig
from pagedserve.executor.base import Executor, UniProcExecutor, WorkerFailedError


def make_executor(config: EngineConfig, model_path: str, eos_token_ids: set[int]) -> Executor:
    if config.tensor_parallel_size == 1:
        from pagedserve.worker.worker import Worker
        return UniProcExecutor(Worker.load(config, model_path, eos_token_ids))
    from pagedserve.executor.tensor_parallel import TensorParallelExecutor
    if config.distributed_executor_backend == "ray":
        from pagedserve.executor.ray_ranks import RayRanks
        ranks = RayRanks(config)
    else:
        from pagedserve.executor.mp_ranks import MultiprocRanks
        ranks = MultiprocRanks(config)
    return TensorParallelExecutor(config, model_path, eos_token_ids, ranks)


__all__ = ["Executor", "UniProcExecutor", "WorkerFailedError", "make_executor"]
