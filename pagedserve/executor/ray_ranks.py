"""The `ray` backend: ranks 1..N-1 as Ray actors, placed by a placement group, so they may
live on any machines of a Ray cluster (`ray start --head` on one, `ray start --address
HEAD:6379` on the others, then start the engine on the head). The driver (rank 0) stays
in the engine's process; the ranks meet it at this machine's address.

A rank that raises returns its traceback and exits; a rank that is killed is seen as a
dead actor. Ray ends every actor with its owner, the engine's process."""
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

    def init_method(self) -> str:
        import ray
        host = self.config.tensor_parallel_host or ray.util.get_node_ip_address()   # never 0.0.0.0
        return f"tcp://{host}:{free_port(host)}"

    def start(self, model_path: str, eos_token_ids: set[int], init_method: str) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        n = self.config.tensor_parallel_size
        gpu = (self.config.device or "").startswith("cuda")
        bundle = {"GPU": 1, "CPU": 1} if gpu else {"CPU": 1}
        self.placement_group = placement_group([bundle] * (n - 1), strategy="PACK")
        ray.get(self.placement_group.ready(), timeout=300)
        actor_class = ray.remote(RankActor)
        for rank in range(1, n):
            strategy = PlacementGroupSchedulingStrategy(self.placement_group, placement_group_bundle_index=rank - 1)
            actor = actor_class.options(num_cpus=1, num_gpus=1 if gpu else 0, scheduling_strategy=strategy,
                                        name=None).remote()
            self.actors.append(actor)
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
        for actor in self.actors:
            ray.kill(actor)
        if self.placement_group is not None:
            from ray.util.placement_group import remove_placement_group
            remove_placement_group(self.placement_group)
            self.placement_group = None
