"""The `mp` backend: ranks 1..N-1 as processes on this machine (torch.multiprocessing, spawn).

A rank that raises reports its traceback on a queue and exits; one that is killed is seen
by its exit code. A rank exits by itself when its parent (the engine's process) is gone,
so none outlives the engine, however the engine ends."""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
import traceback
import weakref

import torch.multiprocessing as mp

from pagedserve.config import EngineConfig
from pagedserve.distributed.group import free_port
from pagedserve.executor.rank import run_rank, threads_per_rank
from pagedserve.executor.tensor_parallel import RankFailure, Ranks, wait_until

logger = logging.getLogger(__name__)


class MultiprocRanks(Ranks):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._ctx = mp.get_context("spawn")
        self._errors = self._ctx.SimpleQueue()
        self._reports: dict[int, str] = {}
        self.processes: list = []
        self._finalizer = None

    def init_method(self) -> str:
        host = self.config.tensor_parallel_host or "127.0.0.1"
        return f"tcp://{host}:{free_port(host)}"

    def start(self, model_path: str, eos_token_ids: set[int], init_method: str) -> None:
        for rank in range(1, self.config.tensor_parallel_size):
            p = self._ctx.Process(target=_rank_main, name=f"pagedserve-tp-rank{rank}", daemon=True,
                                  args=(rank, self.config, model_path, eos_token_ids, init_method, self._errors,
                                        os.getpid()))
            p.start()
            self.processes.append(p)
        # However this object ends (garbage, interpreter exit), no rank outlives it.
        self._finalizer = weakref.finalize(self, _kill, list(self.processes))

    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def failures(self, wait: bool = True) -> list[RankFailure]:
        if wait:
            # A rank that failed exits at once; give it a moment to (and the others that saw it go).
            wait_until(lambda: any(not p.is_alive() for p in self.processes), 3.0)
            time.sleep(0.3)
        while not self._errors.empty():
            rank, report = self._errors.get()
            self._reports[rank] = report
        out = []
        for rank, p in enumerate(self.processes, start=1):
            if rank in self._reports:
                out.append(RankFailure(rank, p.pid, f"raised: {self._reports[rank].strip().splitlines()[-1]}",
                                       died=False))
            elif not p.is_alive():
                out.append(RankFailure(rank, p.pid, f"died ({_exit_status(p.exitcode)})", died=True))
        return out

    def stop(self, graceful: bool) -> None:
        if graceful:
            wait_until(lambda: not any(p.is_alive() for p in self.processes), 10.0)
        _kill(self.processes)


def _kill(processes: list) -> None:
    for p in processes:
        if p.is_alive():
            p.kill()
    for p in processes:
        p.join(5)


def _exit_status(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        return f"killed by signal {signal.Signals(-code).name}"
    return f"exit code {code}"


def _rank_main(rank: int, config: EngineConfig, model_path: str, eos_token_ids: set[int], init_method: str,
               errors, parent_pid: int) -> None:
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    os.environ["OMP_NUM_THREADS"] = str(threads_per_rank(config))   # before the CPU kernels load
    try:
        run_rank(rank, config, model_path, eos_token_ids, init_method)
    except BaseException:   # noqa: BLE001 - reported to the driver, then this rank is gone
        errors.put((rank, traceback.format_exc()))
        os._exit(1)         # at once: the closed connections fail the driver's collective


def _exit_with_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os._exit(1)
