"""The executor interface the engine calls, and the one-process executor."""
from __future__ import annotations

from collections.abc import Collection

from pagedserve.batch import RunnerOutput, StepBatch, TierReport
from pagedserve.worker.worker import Worker


class WorkerFailedError(RuntimeError):
    """A tensor-parallel rank died, raised or stopped answering: the engine cannot go on.
    `rank` is the rank at fault (the first one found; None if none could be named)."""

    def __init__(self, message: str, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


class Executor:
    """Runs each step's batch on the model's workers and returns the driver's result.
    `worker` is the driver's (rank 0's) Worker: its runner samples, and its fields say what
    the engine plans with (the model's shape, the number of KV blocks)."""
    worker: Worker

    @property
    def runner(self):
        return self.worker.runner

    def execute(self, batch: StepBatch) -> RunnerOutput:
        raise NotImplementedError

    def move_blocks(self, batch: StepBatch) -> None:
        """A step that computes nothing still moves its blocks (swaps) on every rank."""
        raise NotImplementedError

    def tier_report(self, wait: Collection[bytes] = ()) -> TierReport | None:
        """The disk tier's news (the driver's store; a step that computed nothing asks here)."""
        return self.runner.tier_report(wait)

    def forget_sequences(self) -> None:
        """Every sequence's state dropped (only the driver samples, so only it keeps any)."""
        self.runner.forget_sequences()

    def worker_pids(self) -> list[int]:
        """The processes of the ranks other than the driver."""
        return []

    def shutdown(self) -> None:
        if self.runner.tier is not None:
            self.runner.tier.close()   # the disk tier's saves reach the disk


class UniProcExecutor(Executor):
    """The whole model in the engine's process."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    def execute(self, batch: StepBatch) -> RunnerOutput:
        return self.runner.execute(batch)

    def move_blocks(self, batch: StepBatch) -> None:
        self.runner.move_blocks(batch)
