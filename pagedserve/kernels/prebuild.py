"""Build the CPU kernel libraries ahead of their first use (`pagedserve kernels`, run by
scripts/setup.sh), so the first `pagedserve generate` on a machine starts in seconds instead of
waiting for the compiler. Each library's variant for this CPU (or, with all_variants, every
variant it supports: what the tests switch between) goes into the same cache a run loads from."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from pagedserve.kernels import cpu


@dataclass(frozen=True)
class Built:
    library: str          # the entry file's name, e.g. cpu_kernels.cpp
    variant: str
    path: Path | None     # None: the build failed (error says why)
    seconds: float
    cached: bool          # it was there already
    error: str = ""


def libraries() -> list[cpu.KernelLibrary]:
    from pagedserve.kernels import quant      # quant imports cpu: imported here, not at module level
    return [cpu.KERNELS, quant.KERNELS]


def prebuild(all_variants: bool = False, libs: list[cpu.KernelLibrary] | None = None) -> list[Built]:
    """Compile what a run on this CPU loads (the variant each library would choose; every
    supported one with all_variants), two compilers at a time (the libraries are independent)."""
    jobs = [(lib, name) for lib in (libs if libs is not None else libraries())
            for name in (lib.supported() if all_variants else [lib.choose()])]

    def one(job: tuple[cpu.KernelLibrary, str]) -> Built:
        lib, name = job
        cached = cpu.library_path(lib.by_name[name], lib.source).exists()
        start = time.perf_counter()
        try:
            path = cpu._build(lib.by_name[name], lib.source)
        except Exception as e:       # a missing compiler, a compiler without the variant's flags
            detail = getattr(e, "stderr", "") or str(e)
            return Built(lib.source.name, name, None, time.perf_counter() - start, False, detail[-2000:])
        return Built(lib.source.name, name, path, time.perf_counter() - start, cached)

    with ThreadPoolExecutor(max_workers=2) as pool:
        return list(pool.map(one, jobs))
