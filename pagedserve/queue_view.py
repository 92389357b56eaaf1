"""`QueueView`: a read-only view of the scheduler's queues (scheduler.py's `Scheduler.queues`)."""
from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from pagedserve.request import Request

if TYPE_CHECKING:
    from pagedserve.scheduler import Scheduler


class QueueView:
    """A read-only view of a scheduler's queues, for those who look but never change them: the
    stats, the dashboard's snapshot, the watchdog and the grammar waits (`Scheduler.queues`).
    It copies nothing: read it on the engine's thread, between steps."""

    def __init__(self, sched: "Scheduler") -> None:
        self._sched = sched

    @property
    def num_running(self) -> int:
        return len(self._sched.running)

    @property
    def num_waiting(self) -> int:
        return len(self._sched.waiting)

    @property
    def num_swapped(self) -> int:
        return len(self._sched.swapped)

    def by_status(self) -> Iterator[tuple[str, Request]]:
        """Every unfinished request with its queue's name: running, swapped, then waiting."""
        s = self._sched
        for status, queue in (("running", s.running), ("swapped", s.swapped), ("waiting", s.waiting)):
            for req in queue:
                yield status, req

    def waiting_for_grammars(self) -> list[Request]:
        """Waiting requests whose grammar is still compiling."""
        return [r for r in self._sched.waiting if r.waiting_for_grammar]

    def failed_grammars(self) -> list[Request]:
        """Waiting requests whose grammar failed to compile."""
        return [r for r in self._sched.waiting if r.structured is not None and r.structured.error is not None]

    def only_waiting_for_grammars(self) -> bool:
        """Every unfinished request waits for its grammar: a step would do nothing."""
        s = self._sched
        return bool(s.waiting) and not s.running and not s.swapped and all(r.waiting_for_grammar for r in s.waiting)
