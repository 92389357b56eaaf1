"""The `local` device preset: rates measured on this machine, in the engine's dtype and
threads, so its efficiency factors are 1 (a measured rate is what the kernels reach).

- matmul_flops: a [256, 2048] x [2048, 2048] matrix multiply (a prefill's linear layer);
- memory_bandwidth: a [1, 4096] x [4096, 8192] product (decode: every weight read once,
  128 MiB in float32, far beyond the caches);
- step_overhead_s: supplied by the caller (benchmarks/sim_validate.py measures one engine
  step of one decoding sequence and subtracts the cost model's kernel time for it).
Measured once with `python -m pagedserve.sim.local` (or by sim_validate.py) and saved as JSON.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from pagedserve.sim.devices import Device, Efficiency

DEFAULT_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "local_device.json"


def _best_time(fn, reps: int) -> float:
    fn()   # warm up
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_local_device(dtype: torch.dtype = torch.float32, reps: int = 5, step_overhead_s: float = 0.0,
                         linear=torch.nn.functional.linear, pack=lambda w: w) -> Device:
    """`linear(x, packed_weight)` and `pack(weight)`: the engine's own matmul (its ops'
    linear and weight packing), so that the rates are those its layers reach."""
    a, b = torch.randn(256, 2048, dtype=dtype), pack(torch.randn(2048, 2048, dtype=dtype))
    flops = 2 * 256 * 2048 * 2048 / _best_time(lambda: linear(a, b), reps)
    x, raw = torch.randn(1, 4096, dtype=dtype), torch.randn(8192, 4096, dtype=dtype)
    w = pack(raw)
    bandwidth = raw.numel() * raw.element_size() / _best_time(lambda: linear(x, w), reps)
    memory = 0
    try:
        import os
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        pass
    return Device("local", flops, bandwidth, memory, 0.0, Efficiency(step_overhead_s=step_overhead_s),
                  f"measured on this machine ({torch.get_num_threads()} threads, {str(dtype).removeprefix('torch.')})")


def save_local_device(device: Device, path: Path | str = DEFAULT_PATH) -> None:
    d = {k: v for k, v in device.__dict__.items() if k != "efficiency"}
    d["efficiency"] = device.efficiency.__dict__
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(d, indent=1))


def load_local_device(path: Path | str | None = None) -> Device:
    path = Path(path or DEFAULT_PATH)
    if not path.exists():
        raise FileNotFoundError(f"no measured local preset at {path}: run benchmarks/sim_validate.py first")
    d = json.loads(path.read_text())
    d["efficiency"] = Efficiency(**d["efficiency"])
    return Device(**d)


if __name__ == "__main__":
    dev = measure_local_device()
    save_local_device(dev)
    print(f"matmul {dev.matmul_flops / 1e9:.1f} GFLOP/s, memory {dev.memory_bandwidth / 1e9:.1f} GB/s "
          f"-> {DEFAULT_PATH}")
