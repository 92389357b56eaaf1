"""The `ray` backend: ranks 1..N-1 as Ray actors, placed by a placement group, so they may
live on any machines of a Ray cluster (`ray start --head` on one, `ray start --address
HEAD:6379` on the others, then start the engine on the head). The driver (rank 0) stays
in the engine's process; the ranks meet it at this machine's address.

A rank that raises returns its traceback and exits; a rank that is killed is seen as a
dead actor. Ray ends every actor with its owner, the engine's process.

On GPUs the placement group holds a bundle for every rank, the driver's too: bundle 0 is
pinned to the driver's node, and a small actor in it (`GpuHolder`) holds its GPU for the
run and tells the driver which one Ray gave it; the rank actors get bundles 1..N-1. So no
two ranks share a device (NCCL refuses that), which the driver taking cuda:0 outside Ray
could not promise."""
from __future__ import annotations

import logging
import os
import threading
import traceback

from pagedserve.config import EngineConfig
from pagedserve.distributed.group import free_port
from pagedserve.executor.rank import run_rank, threads_per_rank
from pagedserve.executor.tensor_parallel import RankFailure, Ranks

logger = logging.getLogger(__name__)


class RankActor:
    """One rank (wrapped by ray.remote when the backend starts)."""

    def pid(self) -> int:
        return os.getpid()

    def gpu_ids(self) -> list[str]:
        import ray
        return [str(i) for i in ray.get_gpu_ids()]

    def run(self, rank: int, config: EngineConfig, model_path: str, eos_token_ids: set[int],
            init_method: str) -> str | None:
        """Runs until the driver says stop (None); on an error, its traceback (the actor then
        exits, which closes its connections and fails the driver's collective)."""
        os.environ["OMP_NUM_THREADS"] = str(threads_per_rank(config))
        try:
            run_rank(rank, config, model_path, eos_token_ids, init_method)
            return None
        except BaseException:   # noqa: BLE001 - handed to the driver
            threading.Timer(0.5, os._exit, (1,)).start()
            return traceback.format_exc()


class GpuHolder:
    """Sits in the driver's bundle: holds its GPU for the run and names it."""

    def gpu_ids(self) -> list[str]:
        import ray
        return [str(i) for i in ray.get_gpu_ids()]


def placement_bundles(world_size: int, gpu: bool, driver_node_ip: str) -> list[dict]:
    """The placement group's bundles. On GPUs: one per rank, bundle r for rank r, the
    driver's (0) on its own node; on CPUs: one per rank actor (1..N-1), the driver's
    process takes nothing from Ray."""
    if not gpu:
        return [{"CPU": 1}] * (world_size - 1)
    return [{"GPU": 1, "CPU": 1, f"node:{driver_node_ip}": 0.001}] + [{"GPU": 1, "CPU": 1}] * (world_size - 1)


def bundle_index(rank: int, gpu: bool) -> int:
    return rank if gpu else rank - 1


def local_device_index(ray_gpu_id: str, cuda_visible_devices: str | None) -> int:
    """The CUDA device index, in this process, of the GPU Ray calls ray_gpu_id (its id among
    the node's GPUs): its position in CUDA_VISIBLE_DEVICES when that is set, else the id."""
    if cuda_visible_devices:
        visible = [d.strip() for d in cuda_visible_devices.split(",")]
        if ray_gpu_id not in visible:
            raise ValueError(f"Ray gave the driver GPU {ray_gpu_id}, which this process cannot see "
                             f"(CUDA_VISIBLE_DEVICES={cuda_visible_devices})")
        return visible.index(ray_gpu_id)
    return int(ray_gpu_id)


class RayRanks(Ranks):
    def __init__(self, config: EngineConfig) -> None:
        import ray
        self.config = config
        if not ray.is_initialized():
            ray.init()            # the cluster at $RAY_ADDRESS or a running local one, else a new local one
        self.actors: list = []
        self.runs: list = []
        self._pids: list[int] = []
        self.placement_group = None
        self.gpu = (config.device or "").startswith("cuda")
        self.holder = None                   # GpuHolder in the driver's bundle (GPUs only)
        self.driver_gpu_id: str | None = None

    def init_method(self) -> str:
        import ray
        host = self.config.tensor_parallel_host or ray.util.get_node_ip_address()   # never 0.0.0.0
        return f"tcp://{host}:{free_port(host)}"

    def driver_device(self):
        """The driver's GPU: the one Ray reserved in bundle 0 (None on CPUs)."""
        import torch
        if self.driver_gpu_id is None:
            return None
        return torch.device("cuda", local_device_index(self.driver_gpu_id, os.environ.get("CUDA_VISIBLE_DEVICES")))

    def reserve(self) -> None:
        """The placement group, and on GPUs the driver's GPU (held by a GpuHolder)."""
        import ray
        from ray.util.placement_group import placement_group
        bundles = placement_bundles(self.config.tensor_parallel_size, self.gpu, ray.util.get_node_ip_address())
        self.placement_group = placement_group(bundles, strategy="PACK")
        ray.get(self.placement_group.ready(), timeout=300)
        if self.gpu:
            self.holder = ray.remote(GpuHolder).options(num_cpus=0, num_gpus=1,
                                                        scheduling_strategy=self._strategy(0)).remote()
            (self.driver_gpu_id,) = ray.get(self.holder.gpu_ids.remote(), timeout=300)

    def spawn(self, rank: int):
        """Rank `rank`'s actor in its bundle (not yet running)."""
        import ray
        return ray.remote(RankActor).options(num_cpus=1, num_gpus=1 if self.gpu else 0,
                                             scheduling_strategy=self._strategy(rank), name=None).remote()

    def _strategy(self, rank: int):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        return PlacementGroupSchedulingStrategy(self.placement_group,
                                                placement_group_bundle_index=bundle_index(rank, self.gpu))

    def start(self, model_path: str, eos_token_ids: set[int], init_method: str) -> None:
        import ray
        self.reserve()
        self.actors = [self.spawn(rank) for rank in range(1, self.config.tensor_parallel_size)]
        self._pids = ray.get([a.pid.remote() for a in self.actors])
        self.runs = [a.run.remote(rank, self.config, model_path, eos_token_ids, init_method)
                     for rank, a in enumerate(self.actors, start=1)]

    def pids(self) -> list[int]:
        return list(self._pids)

    def failures(self, wait: bool = True) -> list[RankFailure]:
        import ray
        if not self.runs:
            return []
        done, _ = ray.wait(self.runs, num_returns=len(self.runs), timeout=3.0 if wait else 0)
        out = []
        for rank, (run, pid) in enumerate(zip(self.runs, self._pids), start=1):
            if run not in done:
                continue
            try:
                report = ray.get(run)
            except Exception as e:   # noqa: BLE001 - the actor died
                out.append(RankFailure(rank, pid, f"died (Ray: {type(e).__name__})", died=True))
                continue
            if report is not None:
                out.append(RankFailure(rank, pid, f"raised: {report.strip().splitlines()[-1]}", died=False))
        return out

    def stop(self, graceful: bool) -> None:
        import ray
        if graceful and self.runs:
            ray.wait(self.runs, num_returns=len(self.runs), timeout=10)
        for actor in self.actors + ([self.holder] if self.holder is not None else []):
            ray.kill(actor)
        self.holder = None
        if self.placement_group is not None:
            from ray.util.placement_group import remove_placement_group
            remove_placement_group(self.placement_group)
            self.placement_group = None
