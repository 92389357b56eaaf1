"""CompilePool: the threads grammars compile on, with abandonment.

The time limit is not the pool's: a trial compile in a child process enforces it
(compile_process.py). A task nobody wants any more (its client left) is handled so:
- a queued task that is abandoned leaves the queue (it never runs);
- a running task that is abandoned becomes an orphan (its owner also stops what it can, e.g.
  kills its trial compile's child): its future is answered at once
  (an error), its result is dropped when it ends, and the pool starts a spare thread so that
  `num_threads` threads stay free for wanted work (at most `max_orphans` orphans run at a time;
  beyond that new work waits for one to end, which the per-request size caps keep short);
- threads are daemons: an orphan never holds the process's exit (SIGTERM), and `close()` answers
  every queued and running task at once.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False)
class Task:
    fn: Callable[[], Any]
    future: Future = field(default_factory=Future)
    started: float | None = None     # time.monotonic() when a thread took it
    orphan: bool = False             # nobody waits for its result any more


class CompilePool:
    def __init__(self, num_threads: int, max_orphans: int = 4, name: str = "pagedserve-grammar") -> None:
        self.num_threads = max(1, num_threads)
        self.max_orphans = max_orphans
        self._name = name
        self._cond = threading.Condition()
        self._queue: deque[Task] = deque()
        self._running: set[Task] = set()
        self._threads = 0
        self._idle = 0
        self._orphans = 0            # orphaned tasks still running
        self._closed = False

    # ---- callers -----------------------------------------------------------------------------
    def submit(self, fn: Callable[[], Any]) -> Task:
        task = Task(fn)
        with self._cond:
            if self._closed:
                task.future.set_exception(RuntimeError("the compile pool is shut down"))
                return task
            self._queue.append(task)
            self._spawn_if_needed()
            self._cond.notify_all()
        return task

    def abandon(self, task: Task, error: BaseException) -> None:
        """Nobody wants the task's result: answer its future with `error`; drop it from the
        queue, or let it run on as an orphan."""
        with self._cond:
            if task.orphan or task.future.done():
                return
            if task in self._running:
                self._orphan(task)
            else:
                try:
                    self._queue.remove(task)
                except ValueError:
                    pass
        _answer(task.future, error=error)

    def close(self, error: BaseException) -> None:
        """Answer every queued and running task with `error`; threads end as they finish."""
        with self._cond:
            self._closed = True
            tasks = list(self._queue) + list(self._running)
            self._queue.clear()
            for task in self._running:
                task.orphan = True
            self._cond.notify_all()
        for task in tasks:
            _answer(task.future, error=error)

    # ---- threads -----------------------------------------------------------------------------
    def _spawn_if_needed(self) -> None:
        """(Lock held.) A thread for the queued work if every thread is busy and the free ones
        are fewer than num_threads (orphans do not count) within the orphan allowance."""
        free_slots = self.num_threads + min(self._orphans, self.max_orphans)
        if self._idle == 0 and self._threads < free_slots and self._queue:
            self._threads += 1
            threading.Thread(target=self._work, name=f"{self._name}-{self._threads}", daemon=True).start()

    def _orphan(self, task: Task) -> None:
        task.orphan = True
        self._orphans += 1
        self._spawn_if_needed()

    def _work(self) -> None:
        while True:
            with self._cond:
                self._idle += 1
                while not self._queue and not self._closed:
                    self._cond.wait()
                self._idle -= 1
                if not self._queue:   # closed
                    self._threads -= 1
                    return
                task = self._queue.popleft()
                task.started = time.monotonic()
                self._running.add(task)
            try:
                result, error = task.fn(), None
            except BaseException as e:   # noqa: BLE001 - handed to whoever waits on the future
                result, error = None, e
            with self._cond:
                self._running.discard(task)
                if task.orphan:
                    self._orphans -= 1
                    # The orphan's spare thread takes over: one thread too many leaves.
                    if self._threads > self.num_threads + min(self._orphans, self.max_orphans) or self._closed:
                        self._threads -= 1
                        return
                    continue
            _answer(task.future, result, error)


def _answer(future: Future, result: Any = None, error: BaseException | None = None) -> None:
    """Set a future's outcome unless it has one already (a timeout or close may come first)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except Exception:   # noqa: BLE001 - InvalidStateError: answered already
        pass
