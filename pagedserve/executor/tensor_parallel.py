"""Tensor parallelism in SPMD fashion: one scheduler, N ranks running the same step.

The driver (rank 0) lives in the engine's process and holds a shard like every rank;
a backend (mp_ranks.py, ray_ranks.py) starts ranks 1..N-1 elsewhere. Each step the
driver broadcasts the StepBatch (plain data) over the control group, every rank performs
the same block moves and runs its shard of the forward (all-reduces between them), the
driver gathers the logits and samples, alone.

Any failure inside a step is fatal: the ranks may be out of step, so the executor stops
every rank and raises WorkerFailedError naming the rank at fault (the backend tells which
died or raised); every later call raises it again.
"""
from __future__ import annotations

import logging
import threading
import time

import torch

from pagedserve.batch import RunnerOutput, StepBatch
from pagedserve.config import EngineConfig
from pagedserve.distributed.group import TensorParallelGroup
from pagedserve.distributed.wire import new_secret
from pagedserve.executor.base import Executor, WorkerFailedError
from pagedserve.executor.rank import EXECUTE, MOVE_BLOCKS, STOP, rank_device, threads_per_rank

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT = 600.0   # seconds for every rank to meet the driver and load its shard


class RankFailure:
    """What a backend knows of a rank that failed."""

    def __init__(self, rank: int, pid: int | None, what: str, died: bool) -> None:
        self.rank, self.pid, self.what, self.died = rank, pid, what, died

    def __str__(self) -> str:
        return f"tensor-parallel rank {self.rank} (pid {self.pid}) {self.what}"


class Ranks:
    """A backend's handle on ranks 1..N-1."""

    def init_method(self) -> str:
        """Where the ranks meet the driver (tcp://host:port)."""
        raise NotImplementedError

    def start(self, model_path: str, eos_token_ids: set[int], init_method: str) -> None:
        raise NotImplementedError

    def driver_device(self) -> torch.device | None:
        """The driver's device where the backend placed it (ray on GPUs); None: rank_device's."""
        return None

    def failures(self, wait: bool = True) -> list[RankFailure]:
        """Ranks that died or reported an error so far (`wait`: a moment for ones about to)."""
        raise NotImplementedError

    def pids(self) -> list[int]:
        raise NotImplementedError

    def stop(self, graceful: bool) -> None:
        """Wait for the ranks to exit (graceful: they were told to stop), then kill what is left."""
        raise NotImplementedError


class TensorParallelExecutor(Executor):
    def __init__(self, config: EngineConfig, model_path: str, eos_token_ids: set[int], ranks: Ranks) -> None:
        from pagedserve.worker.worker import Worker
        self.config = config
        self.ranks = ranks
        self.group: TensorParallelGroup | None = None
        self.failed: WorkerFailedError | None = None
        self._stopped = False
        n, threads = config.tensor_parallel_size, threads_per_rank(config)
        logger.info("tensor parallelism: %d ranks (%s backend), %d threads each", n,
                    config.distributed_executor_backend, threads)
        # The rendezvous address, and this launch's secret: the ranks refuse commands without it.
        init_method = f"{ranks.init_method()}#{new_secret()}"

        def start_driver() -> None:
            torch.set_num_threads(threads)
            device = self.ranks.driver_device() or rank_device(config, 0)
            self.group = TensorParallelGroup(0, n, init_method, device, config.distributed_timeout)
            self.worker = Worker.load(config, model_path, eos_token_ids, self.group, device)

        try:
            ranks.start(model_path, eos_token_ids, init_method)
            self._start_watching_ranks(start_driver)
        except (ValueError, KeyError, FileNotFoundError):
            self.shutdown()       # the driver's own refusal (a model that does not split, ...)
            raise
        except BaseException as e:
            error = e if isinstance(e, WorkerFailedError) else self._diagnose(e)
            self.shutdown()
            raise error from e
        logger.info("tensor-parallel ranks 1..%d started (pids %s)", n - 1, ranks.pids())

    def _start_watching_ranks(self, start_driver) -> None:
        """Run the driver's start (meeting the ranks, loading its shard) on a helper thread
        while watching the ranks: one that dies before it connects would otherwise leave
        the driver waiting for it."""
        outcome: list[BaseException | None] = []

        def run() -> None:
            try:
                start_driver()
                outcome.append(None)
            except BaseException as e:   # noqa: BLE001 - re-raised on the caller's thread
                outcome.append(e)

        thread = threading.Thread(target=run, name="pagedserve-tp-start", daemon=True)
        thread.start()
        deadline = time.monotonic() + max(STARTUP_TIMEOUT, self.config.distributed_timeout)
        while thread.is_alive():
            thread.join(0.2)
            dead = [f for f in self.ranks.failures(wait=False) if f.died]
            if dead and thread.is_alive():
                raise WorkerFailedError(f"{dead[0]} while starting (a script that builds the engine at import "
                                        f"time must do so under `if __name__ == '__main__':`, since ranks "
                                        f"start by spawning)", dead[0].rank)
            if time.monotonic() > deadline:
                raise WorkerFailedError(f"the tensor-parallel ranks did not start within {STARTUP_TIMEOUT}s")
        if outcome[0] is not None:
            raise outcome[0]

    # ---- steps ---------------------------------------------------------------------------
    def execute(self, batch: StepBatch) -> RunnerOutput:
        return self._on_every_rank(EXECUTE, batch, self.runner.execute)

    def move_blocks(self, batch: StepBatch) -> None:
        self._on_every_rank(MOVE_BLOCKS, batch, self.runner.move_blocks)

    def _on_every_rank(self, kind: str, batch: StepBatch, run):
        if self.failed:
            raise self.failed
        try:
            self.group.broadcast((kind, batch))
            return run(batch)
        except Exception as e:   # noqa: BLE001 - the ranks may be out of step: nothing can go on
            self.failed = self._diagnose(e)
            logger.error("%s; stopping every rank", self.failed)
            self.shutdown()
            raise self.failed from e

    def _diagnose(self, error: BaseException) -> WorkerFailedError:
        """A WorkerFailedError naming the ranks that died or raised (the driver itself if none did)."""
        failures = self.ranks.failures()
        if not failures:
            return WorkerFailedError(
                f"a tensor-parallel step failed on the driver (rank 0) and no other rank died or raised: {error!r} "
                f"(a rank that stops answering fails the step after distributed_timeout="
                f"{self.config.distributed_timeout}s; ranks 1.. still running: pids {self.ranks.pids()})")
        failures.sort(key=lambda f: not f.died)   # a dead rank is the cause; the others saw it go
        message = "; ".join(str(f) for f in failures)
        return WorkerFailedError(f"{message} (driver: {error!r})", failures[0].rank)

    # ---- life ----------------------------------------------------------------------------
    def worker_pids(self) -> list[int]:
        return self.ranks.pids()

    def shutdown(self) -> None:
        """Tell the ranks to stop (when they are in step), wait for them, kill what is left."""
        if self._stopped:
            return
        self._stopped = True
        graceful = self.group is not None and self.failed is None
        if graceful:
            try:
                self.group.broadcast((STOP, None))
            except Exception:   # noqa: BLE001 - they are killed below
                graceful = False
        self.ranks.stop(graceful)
        if self.group is not None:
            # After a failure a collective may never complete: leave the group to process exit.
            if graceful:
                self.group.destroy()
            else:
                _abandon_process_group()


def _abandon_process_group() -> None:
    """Forget a process group whose peers are gone (destroying it could wait on them)."""
    import torch.distributed as dist
    try:
        dist.destroy_process_group()
    except Exception:   # noqa: BLE001 - nothing more can be done for it
        logger.warning("could not destroy the tensor-parallel process group", exc_info=True)


def wait_until(condition, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True
