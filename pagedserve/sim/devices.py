"""Device presets for the step-time cost model: datasheet peaks, and the efficiency factors
that turn them into what kernels reach, one per operation class, each with its source.

The factors are fixed here, before any simulation, from published measurements; they are
never tuned to make a result come out. Where a factor is an assumption rather than a
measurement, its source says so. `local` is different: its rates are measured on the
machine itself (sim/local.py), so its factors are 1 (the measured rate is what kernels reach).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

GB = 1e9
GiB = 1024**3
TFLOPS = 1e12


@dataclass(frozen=True)
class Efficiency:
    """Achieved / peak, per operation class."""
    matmul: float = 1.0          # dense matrix multiplies (linear layers, LM head) vs matmul_flops
    attention: float = 1.0       # prefill attention FLOPs vs matmul_flops
    memory: float = 1.0          # streaming weights and KV vs memory_bandwidth
    allreduce: float = 1.0       # ring all-reduce bus bandwidth vs link_bandwidth
    allreduce_latency_s: float = 0.0   # fixed cost of one all-reduce
    step_overhead_s: float = 0.0       # fixed cost of one step outside the kernels (scheduling, launches)


@dataclass(frozen=True)
class Device:
    name: str
    matmul_flops: float          # dense fp16/bf16 peak, FLOP/s
    memory_bandwidth: float      # bytes/s
    memory_bytes: int
    link_bandwidth: float        # NVLink, bytes/s per GPU per direction (tensor parallelism)
    efficiency: Efficiency
    source: str

    def with_efficiency(self, **changes) -> "Device":
        return dataclasses.replace(self, efficiency=dataclasses.replace(self.efficiency, **changes))


# Efficiency factors for NVIDIA data-centre GPUs, with their sources.
GPU_EFFICIENCY = Efficiency(
    matmul=0.75, attention=0.5, memory=0.88, allreduce=0.75, allreduce_latency_s=10e-6, step_overhead_s=2e-3)
EFFICIENCY_SOURCES = {
    "matmul": "assumption: large fp16 cuBLAS GEMMs reach 70-80% of the dense tensor-core peak on "
              "A100/H100; the middle value, not measured by us",
    "attention": "assumption: attention kernels (FlashAttention-2 on A100: 50-73% of peak forward, "
                 "Dao 2023, Fig. 4-5) reach less than GEMMs; the low end taken",
    "memory": "NVIDIA developer forum, 'Trouble to reach peak bandwidth of A100' (2024): a read "
              "kernel at 88% of the A100-80GB datasheet bandwidth, ~90% the best seen in NVIDIA's GTC talk",
    "allreduce": "assumption: NCCL's ring all-reduce bus bandwidth on NVLink reaches ~75% of the "
                 "per-direction link rate for large messages (nccl-tests on DGX A100 ~230 of 300 GB/s)",
    "allreduce_latency_s": "assumption: ~10 us per small NCCL all-reduce inside one NVLink node",
    "step_overhead_s": "assumption: ~2 ms per step of CPU-side scheduling, input preparation and "
                       "kernel launches in a Python serving engine (vLLM 0.1-era)",
}

DEVICES: dict[str, Device] = {
    "a100-40gb": Device("a100-40gb", 312 * TFLOPS, 1555 * GB, 40 * GiB, 300 * GB, GPU_EFFICIENCY,
                        "NVIDIA A100 datasheet (SXM4 40GB): 312 TFLOPS dense FP16/BF16, 1,555 GB/s HBM2, "
                        "NVLink 600 GB/s (both directions)"),
    "a100-80gb": Device("a100-80gb", 312 * TFLOPS, 2039 * GB, 80 * GiB, 300 * GB, GPU_EFFICIENCY,
                        "NVIDIA A100 datasheet (SXM4 80GB): 312 TFLOPS dense FP16/BF16, 2,039 GB/s HBM2e, "
                        "NVLink 600 GB/s (both directions)"),
    "h100": Device("h100", 989 * TFLOPS, 3350 * GB, 80 * GiB, 450 * GB, GPU_EFFICIENCY,
                   "NVIDIA H100 datasheet (SXM5): 989 TFLOPS dense FP16/BF16, 3.35 TB/s HBM3, NVLink 900 GB/s"),
    "h200": Device("h200", 989 * TFLOPS, 4800 * GB, 141 * GB, 450 * GB, GPU_EFFICIENCY,
                   "NVIDIA H200 datasheet (SXM): 989 TFLOPS dense FP16/BF16, 4.8 TB/s HBM3e, 141 GB, "
                   "NVLink 900 GB/s"),
}


def get_device(name: str, local_path: str | None = None) -> Device:
    """A preset by name; `local` reads the rates measured on this machine (sim/local.py)."""
    if name == "local":
        from pagedserve.sim.local import load_local_device
        return load_local_device(local_path)
    if name not in DEVICES:
        raise ValueError(f"device must be one of {', '.join([*DEVICES, 'local'])}; got {name!r}")
    return DEVICES[name]
