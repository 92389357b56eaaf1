"""Device presets for the step-time cost model: datasheet peaks, and the efficiency factors
that turn them into what kernels reach, one per operation class, each with its source.

The factors are fixed here, before any simulation, from published measurements; they are
never tuned to make a result come out. Where a factor is an assumption rather than a
measurement, its source says so. `local` is different: its rates are measured on the
machine itself (sim/local.py) and it carries a `Calibration`: the cost model then uses the
measured terms instead of a roofline.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pagedserve.sim.calibration import Calibration

GB = 1e9
GiB = 1024**3
TFLOPS = 1e12


@dataclass(frozen=True)
class Efficiency:
    """Achieved / peak, per operation class."""
    matmul: float = 1.0          # dense matrix multiplies (linear layers, LM head) vs matmul_flops
    attention: float = 1.0       # prefill attention FLOPs vs matmul_flops
    memory: float = 1.0          # streaming weights and activations vs memory_bandwidth
    attention_memory: float = 1.0   # attention kernels' KV reads vs memory_bandwidth (a contiguous kernel)
    paged_attention_penalty: float = 1.0   # paged decode attention time / the contiguous kernel's
    allreduce: float = 1.0       # ring all-reduce bus bandwidth vs link_bandwidth
    allreduce_latency_s: float = 0.0   # fixed cost of one all-reduce
    step_overhead_s: float = 0.0       # fixed cost of one step outside the kernels (scheduling, launches)
    per_seq_overhead_s: float = 0.0    # ... and per scheduled sequence (batch preparation, output processing)


@dataclass(frozen=True)
class Device:
    name: str
    matmul_flops: float          # dense fp16/bf16 peak, FLOP/s
    memory_bandwidth: float      # bytes/s
    memory_bytes: int
    link_bandwidth: float        # NVLink, bytes/s per GPU per direction (tensor parallelism)
    efficiency: Efficiency
    source: str
    calibration: Calibration | None = None   # measured terms (the local preset); None: rooflines

    def with_efficiency(self, **changes) -> "Device":
        return dataclasses.replace(self, efficiency=dataclasses.replace(self.efficiency, **changes))


# Efficiency factors for NVIDIA data-centre GPUs, with their sources.
GPU_EFFICIENCY = Efficiency(
    matmul=0.75, attention=0.35, memory=0.88, attention_memory=0.7, paged_attention_penalty=1.23, allreduce=0.75,
    allreduce_latency_s=10e-6, step_overhead_s=2e-3)
EFFICIENCY_SOURCES = {
    "matmul": "assumption: large fp16 cuBLAS GEMMs reach 70-80% of the dense tensor-core peak on "
              "A100/H100; the middle value, not measured by us",
    "attention": "prefill attention FLOPs: FlashAttention (v1) reaches 25-40% of the A100's peak and "
                 "FlashAttention-2 50-73% (Dao 2023, 'FlashAttention-2', abstract); the paper's vLLM (2023) ran "
                 "prompts through xFormers' FlashAttention-1-class kernel: the middle of 25-40%",
    "memory": "NVIDIA developer forum, 'Trouble to reach peak bandwidth of A100' (2024): a read "
              "kernel at 88% of the A100-80GB datasheet bandwidth, ~90% the best seen in NVIDIA's GTC talk",
    "attention_memory": "assumption: a 2023 contiguous decode-attention kernel (FasterTransformer's, the "
                        "paper's reference in Fig. 18a) reads the KV cache below a pure stream's 88%: each "
                        "(sequence, head) is a short reduction with a softmax between its two passes; we found no "
                        "published bandwidth fraction for it, so 0.7 is ours, not a measurement",
    "paged_attention_penalty": "Kwon et al. (SOSP 2023), Sec. 7.1, Fig. 18a: the paged attention kernel has "
                               "20-26% higher latency than FasterTransformer's contiguous one at the kernel level "
                               "(block size 16); the middle, 1.23, on paged decode attention only (the baselines "
                               "run the contiguous kernel; prompts ran through a contiguous kernel in both)",
    "per_seq_overhead_s": "none assumed on GPUs (the 2 ms step cost covers the CPU side)",
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
