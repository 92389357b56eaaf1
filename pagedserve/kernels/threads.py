"""CPU threads: how many, and how they wait.

Both OpenMP users of the CPU path, torch (ATen, MKL, oneDNN) and our kernels
(cpu_kernels.cpp), run on one libgomp (the dynamic linker loads it once, by soname).
libgomp's default wait policy spins for about 300,000 pause instructions (milliseconds)
at every barrier before sleeping. That is free on idle cores and a collapse when the
cores are shared: a thread spins through its time slice waiting for one that is not
running, at each of the hundreds of barriers of a decode step (issue 23 measured
single-stream decode 72x slower with two busy neighbours on 2 cores).

So, before libgomp loads (pagedserve/__init__.py calls `apply_openmp_defaults()` before
anything imports torch), unless the user set them:
- GOMP_SPINCOUNT=10000 (OPENMP_SPINCOUNT): spin briefly, then sleep, so a waiting thread
  gives its core back; barriers of the compiled layer loop are microseconds apart, so
  they still meet while spinning on idle cores;
- OMP_NUM_THREADS = the CPUs this process may use: its affinity mask and its cgroup CPU
  quota (a container limited to 2 CPUs on a 64-core host gets 2 threads, not 64).
PAGEDSERVE_OPENMP_DEFAULTS=0 leaves the environment alone (benchmarks/threads.py's "old").
`configure_threads(n)` (EngineConfig.num_threads) sets the count of the calling thread,
the one that runs the engine's steps.

Several engines in one process (a multi-model server: one engine thread per model) each get
a team of OpenMP workers of their own, which libgomp keeps, asleep, until that thread exits.
libgomp counts every worker of every team, and once they outnumber the CPUs it spins 100
times at each barrier instead of GOMP_SPINCOUNT before sleeping on a futex: a busy model's
decode step then sleeps and wakes at its hundreds of barriers (40x the context switches;
TTFT 22 ms instead of 14 ms with an idle second model loaded). So an engine thread going
idle while another engine lives hands its workers back (`release_thread_team`); the next
step starts them again (tens of microseconds).
"""
from __future__ import annotations

import ctypes
import logging
import math
import os
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

OPENMP_SPINCOUNT = 10000
# What apply_openmp_defaults() found: False if torch (and so libgomp) was loaded before it.
_applied_before_torch: bool | None = None


def cgroup_cpu_limit(root: Path = Path("/sys/fs/cgroup"), proc_cgroup: Path = Path("/proc/self/cgroup")) -> float | None:
    """CPUs allowed by this process's cgroup CPU quota (v2 cpu.max, v1 cfs quota/period), the
    tightest along its cgroup path; None without a quota."""
    limits = []
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":                                   # cgroup v2
            d = root / path.lstrip("/")
            while True:
                limits.append(_read_v2(d / "cpu.max"))
                if d == root or root not in d.parents:
                    break
                d = d.parent
        elif "cpu" in controllers.split(","):                   # cgroup v1
            for base in (root / "cpu", root / "cpu,cpuacct", root / "cpuacct,cpu"):
                limits.append(_read_v1(base / path.lstrip("/")))
                limits.append(_read_v1(base))
    limits = [x for x in limits if x is not None]
    return min(limits) if limits else None


def _read_v2(f: Path) -> float | None:
    try:
        quota, period = f.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def _read_v1(d: Path) -> float | None:
    try:
        quota = int((d / "cpu.cfs_quota_us").read_text())
        period = int((d / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 else quota / period


def available_cpus() -> int:
    """The CPUs this process may use: its affinity mask, capped by its cgroup quota."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    quota = cgroup_cpu_limit()
    if quota is not None:
        cpus = min(cpus, max(1, math.ceil(quota)))
    return max(1, cpus)


def apply_openmp_defaults() -> None:
    """Set OpenMP's wait policy and thread count in the environment, where the user has not,
    before libgomp reads it (it does once, when torch loads it)."""
    global _applied_before_torch
    if _applied_before_torch is not None:
        return
    _applied_before_torch = "torch" not in sys.modules
    if os.environ.get("PAGEDSERVE_OPENMP_DEFAULTS", "1") == "0":
        return
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = str(OPENMP_SPINCOUNT)
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(available_cpus())


def set_thread_count(n: int) -> None:
    """torch's and our kernels' thread count for the steps the calling thread runs (OpenMP's
    count is per thread: torch's libgomp, loaded by now)."""
    import torch
    torch.set_num_threads(n)
    try:
        ctypes.CDLL("libgomp.so.1").omp_set_num_threads(n)
    except (OSError, AttributeError):
        pass


OMP_PAUSE_SOFT = 1       # omp_pause_resource_t: end the threads, keep nothing else


def release_thread_team() -> bool:
    """End the OpenMP worker threads the calling thread's parallel regions started (OpenMP 5's
    omp_pause_resource_all; libgomp frees the caller's pool, and its workers stop counting
    towards the CPUs). False where the runtime lacks it."""
    try:
        pause = ctypes.CDLL("libgomp.so.1").omp_pause_resource_all
    except (OSError, AttributeError):
        return False
    pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
    return pause(OMP_PAUSE_SOFT) == 0


def configure_threads(num_threads: int | None) -> int:
    """Threads for the steps the calling thread runs (torch's and our kernels'): num_threads, or
    OMP_NUM_THREADS, or the CPUs this process may use. Returns the number."""
    env = os.environ.get("OMP_NUM_THREADS", "")
    n = num_threads or (int(env) if env.isdigit() and int(env) > 0 else available_cpus())
    set_thread_count(n)
    if _applied_before_torch is False and os.environ.get("PAGEDSERVE_OPENMP_DEFAULTS", "1") != "0" \
            and "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        logger.warning("torch was imported before pagedserve, so OpenMP keeps its spin-wait default, which "
                       "collapses on shared cores; import pagedserve first or set GOMP_SPINCOUNT=%d",
                       OPENMP_SPINCOUNT)
    logger.info("%d CPU threads (GOMP_SPINCOUNT=%s, OMP_WAIT_POLICY=%s)", n,
                os.environ.get("GOMP_SPINCOUNT", "default"), os.environ.get("OMP_WAIT_POLICY", "default"))
    return n
