"""Reproduce the vLLM paper's headline results on pagedserve's own engine.

    python benchmarks/paper.py [--quick | --sweep] [--out DIR]
    python benchmarks/paper.py --simulate a100-40gb --model-preset opt-13b [--quick] [--out DIR]

`--simulate DEVICE` runs the paper's figures in its own regime on the step-time simulator
instead (benchmarks/paper_sim.py: the real scheduler and KV managers, sim/cost.py's step-time
model of the GPU and model) and writes DIR/paper_sim.json and sim_fig*.png; the rest of this docstring
is the engine run.

The same scheduler, model and attention serve the same traces with the paged KV
cache and with the contiguous-reservation baselines of the paper (kv/contiguous.py:
`max`, `pow2`, `oracle`, the paper's Orca-Max/Pow2/Oracle). Only the KV cache
manager differs, so every difference below is what paging buys. Workloads are
ShareGPT-like and Alpaca-like traces (benchmarks/workloads.py).

Memory (Fig. 2 memory-waste breakdown, Fig. 13 average batch size), at the
paper's scale: 2048-token context, 16-token blocks, a KV cache of 7.5 max-length
sequences (15k slots, like OPT-13B on an A100, where Orca-Max batches 7
requests). The engine's scheduler and KV managers run without the model
(benchmarks/memory_sim.py: which slots a request holds depends only on token
counts), every request queued at once, averaged over the steps while requests
wait: memory is then the only limit on the batch.

Time (Fig. 12 normalized latency vs request rate, Fig. 18b block size), on the
real engine with the default model (bf16 on CPU): requests are added when the
clock passes their Poisson arrival time. The clock advances by the measured wall
time of each engine step and jumps over idle gaps (nothing to run until the next
arrival): what a real-time loop sees, minus the waiting and this script's own
bookkeeping. A 135M model on 2 CPU cores serves far fewer tokens than the
paper's GPUs, so every length here is scaled by `--length-scale` (default 1/8):
the traces' mean lengths, max_model_len, block size and KV cache (the ratios that
decide the results stay the paper's). Per workload:
1. burst: all requests at once; steady-state throughput (finishes between the 10% and
   90% marks: ramp-up and drain left out), the time to drain the whole burst (its own
   figure, `burst_throughput_rps`: not the paper's measure), batch sizes beside
   preemptions and recomputed tokens, and the memory numbers again as measured in the
   engine (a check on the simulation). The traces are long (1000 requests in the full
   run) and the KV cache holds 7.5 max-length sequences, so memory binds for the paged
   cache too;
2. rate sweep at fractions of the highest steady throughput of any allocator, up to
   twice it (past every allocator's capacity): mean over requests of latency / output
   length, and, as the paper reads Fig. 12, the highest rate each allocator sustains
   under a latency bound (a multiple of the paged engine's latency at the lowest rate),
   interpolated between measured rates; its paged / baseline ratio is the headline;
3. the paged engine's normalized latency at one rate for several block sizes.

Writes DIR/paper.json and DIR/fig{2,12,13,18b}_*.png (default benchmarks/results/).
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):   # run as a script: make `benchmarks` and `pagedserve` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.memory_sim import simulate_saturation  # noqa: E402
from benchmarks.workloads import WORKLOADS, make_trace, trace_lengths, trace_stats  # noqa: E402
from pagedserve.config import EngineConfig  # noqa: E402
from pagedserve.executor import UniProcExecutor  # noqa: E402
from pagedserve.engine.llm_engine import LLMEngine  # noqa: E402
from pagedserve.kv.memory_usage import CATEGORIES, MemoryUsage  # noqa: E402
from pagedserve.sampling_params import SamplingParams  # noqa: E402
from pagedserve.scheduler import Scheduler  # noqa: E402
from pagedserve.sim.driver import steady_window, sustained_rate  # noqa: E402
from pagedserve.worker.model_runner import ModelRunner  # noqa: E402
from pagedserve.worker.worker import make_sampler  # noqa: E402

ALLOCATORS = ("paged", "oracle", "pow2", "max")
LABELS = {"paged": "paged (vLLM)", "oracle": "Orca-Oracle", "pow2": "Orca-Pow2", "max": "Orca-Max"}
COLORS = {"paged": "tab:red", "oracle": "tab:blue", "pow2": "tab:green", "max": "tab:purple"}

# The paper's numbers (Kwon et al., SOSP 2023), as quoted in issue 6.
PAPER = {
    "token_state_share": {"paged": 0.963, "orca": "0.204 (Max) to 0.382 (Oracle)"},
    "avg_batch_size_sharegpt": {"paged": 30.42, "oracle": 13.62, "pow2": 9.81, "max": 7.00},
    "sustainable_rate_ratio": {"vs_oracle": "1.7-2.7x", "vs_max": "2.7-8x"},
    "throughput_gain": "2-4x at the same latency",
}

PAPER_MAX_MODEL_LEN = 2048
PAPER_BLOCK_SIZE = 16


@dataclass
class Setup:
    workloads: list[str]
    allocators: list[str]
    kv_capacity: float                   # the KV cache holds this many max-length sequences
    # Memory: the scheduler without a model, at the paper's scale.
    memory_requests: dict[str, int]
    # Time: the real engine, every length scaled by length_scale.
    engine_workloads: list[str]
    length_scale: float
    engine_requests: dict[str, int]
    rate_fractions: list[float]          # of the highest steady (burst) throughput of any allocator
    block_sizes: list[int]               # ablation, actual tokens per block
    ablation_rate_fraction: float
    engine_kv_capacity: float | None = None   # default: kv_capacity
    latency_bound_factor: float = 4.0    # x the paged engine's latency at the lowest rate
    seed: int = 0

    @property
    def max_model_len(self) -> int:
        return max(8, round(PAPER_MAX_MODEL_LEN * self.length_scale))

    @property
    def block_size(self) -> int:
        return max(1, round(PAPER_BLOCK_SIZE * self.length_scale))

    @property
    def kv_slots(self) -> int:
        return int((self.engine_kv_capacity or self.kv_capacity) * self.max_model_len)


def full_setup(scale: float) -> Setup:
    return Setup(workloads=["sharegpt", "alpaca"], allocators=list(ALLOCATORS), kv_capacity=7.5,
                 memory_requests={"sharegpt": 1000, "alpaca": 4000},
                 engine_workloads=["sharegpt", "alpaca"], length_scale=scale,
                 engine_requests={"sharegpt": 1000, "alpaca": 1000},
                 rate_fractions=[0.1, 0.25, 0.4, 0.55, 0.7, 0.85, 1.0, 1.25, 1.5, 2.0],
                 block_sizes=sorted({max(1, round(b * scale)) for b in (8, 16, 32, 64, 128, 256)}),
                 ablation_rate_fraction=0.6)


def sweep_setup() -> Setup:
    """The engine's whole sustained-rate sweep sized for this 2-core machine: both workloads at
    lengths x1/8 (max_model_len 256, block size 2, 1920 KV slots), 300 requests per trace, seven
    rates from a quarter of the highest capacity to twice it, three block sizes. Estimated from
    the earlier runs' step times: ~30 min on a quiet 2-core machine (the low-rate points cost
    most: a trace at rate r lasts 300 / r seconds), well under an hour."""
    return Setup(workloads=["sharegpt", "alpaca"], allocators=list(ALLOCATORS), kv_capacity=7.5,
                 memory_requests={"sharegpt": 1000, "alpaca": 4000},
                 engine_workloads=["sharegpt", "alpaca"], length_scale=1 / 8,
                 engine_requests={"sharegpt": 300, "alpaca": 300},
                 rate_fractions=[0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0], block_sizes=[1, 2, 4],
                 ablation_rate_fraction=0.6)


def quick_setup() -> Setup:
    """A smoke run: fewer requests for the memory simulation, and for the engine only the
    ShareGPT-like trace, scaled by 1/32, with a cache of 2 max-length sequences so that a
    few requests already fill it, two rates and two block sizes."""
    return Setup(workloads=["sharegpt", "alpaca"], allocators=list(ALLOCATORS), kv_capacity=7.5,
                 memory_requests={"sharegpt": 200, "alpaca": 500},
                 engine_workloads=["sharegpt"], length_scale=1 / 32, engine_requests={"sharegpt": 8},
                 rate_fractions=[0.5, 2.0], block_sizes=[1, 4], ablation_rate_fraction=0.6,
                 engine_kv_capacity=2)


# ---- memory, at the paper's scale ------------------------------------------------------------

def run_memory(setup: Setup, workload: str, log) -> dict:
    lengths = trace_lengths(workload, setup.memory_requests[workload], setup.seed, PAPER_MAX_MODEL_LEN)
    slots = int(setup.kv_capacity * PAPER_MAX_MODEL_LEN)
    out = {}
    for a in setup.allocators:
        t0 = time.perf_counter()
        r = simulate_saturation(a, lengths, PAPER_BLOCK_SIZE, slots, PAPER_MAX_MODEL_LEN)
        out[a] = dataclasses.asdict(r)
        log(f"  {workload:8s} {a:6s} memory: batch {r.saturated_batch_size:6.2f}, token states "
            f"{r.shares()['token_states']:6.1%}  ({time.perf_counter() - t0:.0f}s)")
    n = len(lengths)
    return {"num_requests": n, "mean_input": sum(p for p, _ in lengths) / n,
            "mean_output": sum(o for _, o in lengths) / n, "block_size": PAPER_BLOCK_SIZE,
            "max_model_len": PAPER_MAX_MODEL_LEN, "kv_slots": slots, "allocators": out}


# ---- engines over one loaded model -------------------------------------------------------------

def load_base_engine(model: str | None, dtype: str, setup: Setup) -> LLMEngine:
    config = EngineConfig(model=model, dtype=dtype, max_model_len=setup.max_model_len, block_size=setup.block_size,
                          num_gpu_blocks_override=setup.kv_slots // setup.block_size, enable_prefix_caching=False,
                          seed=setup.seed)
    return LLMEngine(config)


def engine_for(base: LLMEngine, kv_allocator: str, block_size: int, kv_slots: int) -> LLMEngine:
    """A fresh engine (new config, scheduler and KV cache) over the base engine's loaded
    model: loading the model takes longer than many of the runs."""
    num_blocks = kv_slots // block_size
    config = dataclasses.replace(base.config, kv_allocator=kv_allocator, block_size=block_size,
                                 num_gpu_blocks_override=num_blocks)
    engine = copy.copy(base)
    engine.config = config
    engine.scheduler = Scheduler(config, num_blocks, base.max_model_len)
    engine.runner = ModelRunner(base.runner.model, num_blocks, block_size,
                                make_sampler(base.eos_token_ids, config.seed, base.device), base.device)
    engine.executor = UniProcExecutor(dataclasses.replace(base.executor.worker, runner=engine.runner,
                                                          num_blocks=num_blocks))
    engine.requests = {}
    return engine


# ---- one engine run ----------------------------------------------------------------------------

@dataclass
class RunResult:
    allocator: str
    workload: str
    rate: float                      # requests/s (inf: all at once)
    block_size: int
    num_requests: int
    duration_s: float                # on the simulated clock
    throughput_rps: float            # the whole run (for a burst: the time to drain it)
    steady_throughput_rps: float     # finishes between the 10% and 90% marks (sim.driver.steady_window)
    output_tokens_per_s: float
    mean_normalized_latency: float   # s per output token, mean over requests
    mean_latency_s: float
    avg_batch_size: float            # requests running per step, over all steps
    saturated_batch_size: float      # ... over the steps while requests were waiting
    saturated_memory: dict           # MemoryUsage summed over those steps
    num_steps: int
    num_preemptions: int
    num_recomputed_tokens: int
    wall_s: float
    latencies: list[float] = field(default_factory=list, repr=False)

    def summary(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("latencies")
        return d


def serve(engine: LLMEngine, trace, workload: str, rate: float) -> RunResult:
    """Serve a trace, adding each request when the simulated clock reaches its arrival."""
    pending = deque(sorted(enumerate(trace), key=lambda r: r[1].arrival_time))
    out_len = {str(i): r.output_len for i, r in enumerate(trace)}
    arrival = {str(i): r.arrival_time for i, r in enumerate(trace)}
    finish: dict[str, float] = {}
    saturated_usage = MemoryUsage()
    batch_sum = saturated_batch_sum = steps = saturated_steps = 0
    preempt0 = engine.scheduler.stats.num_preemptions
    recomputed0 = engine.scheduler.stats.num_recomputed_tokens
    clock, wall0 = 0.0, time.perf_counter()
    while pending or engine.has_unfinished_requests():
        if not engine.has_unfinished_requests() and pending[0][1].arrival_time > clock:
            clock = pending[0][1].arrival_time              # idle until the next request
        while pending and pending[0][1].arrival_time <= clock:
            i, r = pending.popleft()
            engine.add_request(str(i), {"prompt_token_ids": r.prompt_token_ids},
                               SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True))
        start = time.perf_counter()
        outputs = engine.step()
        clock += time.perf_counter() - start
        done = [o.request_id for o in outputs if o.finished]
        for rid in done:
            finish[rid] = clock
        sched = engine.scheduler
        if not sched.running and not done and sched.waiting:
            raise RuntimeError("the engine made no progress with requests waiting")
        batch = len(sched.running) + len(done)   # the requests that held KV memory in this step
        steps += 1
        batch_sum += batch
        if sched.waiting:
            saturated_steps += 1
            saturated_batch_sum += batch
            saturated_usage += engine.memory_usage()
    assert len(finish) == len(trace)
    latencies = [finish[rid] - arrival[rid] for rid in finish]
    norm = [lat / out_len[rid] for rid, lat in zip(finish, latencies)]
    duration = max(finish.values()) - min(arrival.values())
    n = len(trace)
    lo, hi = steady_window(list(arrival.values()), list(finish.values()))
    steady = sum(1 for t in finish.values() if lo < t <= hi) / (hi - lo) if hi > lo else n / duration
    return RunResult(
        allocator=engine.config.kv_allocator, workload=workload, rate=rate, block_size=engine.config.block_size,
        num_requests=n, duration_s=duration, throughput_rps=n / duration, steady_throughput_rps=steady,
        output_tokens_per_s=sum(out_len.values()) / duration,
        mean_normalized_latency=sum(norm) / n, mean_latency_s=sum(latencies) / n,
        avg_batch_size=batch_sum / max(1, steps),
        saturated_batch_size=saturated_batch_sum / saturated_steps if saturated_steps else float("nan"),
        saturated_memory=saturated_usage.as_dict(), num_steps=steps,
        num_preemptions=engine.scheduler.stats.num_preemptions - preempt0,
        num_recomputed_tokens=engine.scheduler.stats.num_recomputed_tokens - recomputed0,
        wall_s=time.perf_counter() - wall0, latencies=latencies)


def warm_up(base: LLMEngine, setup: Setup) -> None:
    """The first steps pay one-time costs (allocations, kernel selection): keep them out."""
    engine = engine_for(base, "paged", setup.block_size, setup.kv_slots)
    trace = make_trace("sharegpt", 4, 12345, base.vocab_size, setup.max_model_len, scale=setup.length_scale)
    serve(engine, trace, "warmup", math.inf)


# ---- time, on the real engine ------------------------------------------------------------------

def shares(memory: dict) -> dict:
    return MemoryUsage(**memory).shares()


def run_engine(base: LLMEngine, setup: Setup, workload: str, log) -> dict:
    n = setup.engine_requests[workload]
    mk = lambda rate: make_trace(workload, n, setup.seed, base.vocab_size, setup.max_model_len,  # noqa: E731
                                 rate, scale=setup.length_scale)
    engines = {a: engine_for(base, a, setup.block_size, setup.kv_slots) for a in setup.allocators}
    result: dict = {"trace": trace_stats(mk(math.inf))}

    # 1. Burst: everything queued at once.
    burst = {}
    for a in setup.allocators:
        r = serve(engines[a], mk(math.inf), workload, math.inf)
        burst[a] = r.summary()
        log(f"  {workload:8s} {a:6s} burst: {r.steady_throughput_rps:6.3f} req/s steady ({r.throughput_rps:6.3f} to "
            f"drain), batch {r.saturated_batch_size:5.1f}, {r.num_preemptions} preemptions, "
            f"{r.num_recomputed_tokens} tokens recomputed, token states "
            f"{shares(r.saturated_memory)['token_states']:.1%}  ({r.wall_s:.0f}s)")
    result["burst"] = burst
    capacity = max(b["steady_throughput_rps"] for b in burst.values())

    # 2. Normalized latency vs request rate, to twice the highest capacity.
    # Rate by rate, all allocators in turn, so that they see similar machine conditions.
    rates = [f * capacity for f in setup.rate_fractions]
    sweep: dict[str, list[dict]] = {a: [] for a in setup.allocators}
    bound = None
    for rate in rates:
        for a in setup.allocators:
            if sweep[a] and sweep[a][-1]["mean_normalized_latency"] > 2 * bound:
                continue   # far past this allocator's knee: higher rates only take longer
            r = serve(engines[a], mk(rate), workload, rate)
            sweep[a].append(r.summary())
            log(f"  {workload:8s} {a:6s} {rate:6.3f} req/s: {r.mean_normalized_latency:.3f} s/token, "
                f"batch {r.avg_batch_size:5.1f}  ({r.wall_s:.0f}s)")
            if bound is None:   # the paged engine at the lowest rate
                bound = setup.latency_bound_factor * r.mean_normalized_latency
    result["rates"] = rates
    result["latency_bound_s_per_token"] = bound
    result["sweep"] = sweep
    result["sustainable_rate"] = {
        a: sustained_rate([(p["rate"], p["mean_normalized_latency"]) for p in pts], bound)
        for a, pts in sweep.items()}

    # 3. Block-size ablation (paged).
    rate = setup.ablation_rate_fraction * capacity
    ablation = []
    for bs in setup.block_sizes:
        r = serve(engine_for(base, "paged", bs, setup.kv_slots), mk(rate), workload, rate)
        ablation.append(r.summary())
        log(f"  {workload:8s} block {bs:3d} at {rate:6.3f} req/s: {r.mean_normalized_latency:.3f} s/token  "
            f"({r.wall_s:.0f}s)")
    result["block_size_ablation"] = {"rate": rate, "runs": ablation}
    return result


def ratios(memory: dict, engine: dict | None) -> dict:
    """paged / baseline for the headline numbers of one workload."""
    mem = memory["allocators"]
    out = {}
    for a in mem:
        if a == "paged":
            continue
        r = {"batch_size": mem["paged"]["saturated_batch_size"] / mem[a]["saturated_batch_size"]}
        if engine and a in engine["burst"]:
            burst, rates = engine["burst"], engine["sustainable_rate"]
            p_rate, a_rate = rates["paged"]["rate"], rates[a]["rate"]
            r["steady_throughput"] = burst["paged"]["steady_throughput_rps"] / burst[a]["steady_throughput_rps"]
            r["burst_throughput"] = burst["paged"]["throughput_rps"] / burst[a]["throughput_rps"]
            r["sustainable_rate"] = p_rate / a_rate if p_rate and a_rate else None
            # The paged engine stayed under the bound at every rate tested: a lower bound.
            r["sustainable_rate_at_least"] = rates["paged"]["note"].startswith("at least")
        out[a] = r
    return out


# ---- figures -----------------------------------------------------------------------------------

def plot(results: dict, setup: Setup, out: Path) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    memory, engine = results["memory"], results["engine"]
    cat_colors = ["tab:green", "tab:orange", "tab:red", "tab:purple", "lightgrey"]

    fig, axes = plt.subplots(len(memory), 1, figsize=(7.5, 2.3 * len(memory) + 0.6), squeeze=False)
    for ax, (w, mem) in zip(axes[:, 0], memory.items()):
        names = list(mem["allocators"])
        left = [0.0] * len(names)
        for cat, color in zip(CATEGORIES, cat_colors):
            vals = [shares(mem["allocators"][a]["saturated_memory"])[cat] * 100 for a in names]
            ax.barh([LABELS[a] for a in names], vals, left=left, color=color, label=cat.replace("_", " "))
            if cat == "token_states":
                for i, v in enumerate(vals):
                    ax.text(1, i, f"{v:.1f}%", va="center", fontsize=8)
            left = [a + b for a, b in zip(left, vals)]
        ax.set_xlim(0, 100)
        ax.invert_yaxis()
        ax.set_title(f"{w}: KV cache slots while requests wait (%)", fontsize=10)
    axes[-1, 0].legend(fontsize=7, ncol=5, loc="upper center", bbox_to_anchor=(0.45, -0.18))
    fig.tight_layout()
    files.append(_save(fig, out / "fig2_memory_waste.png"))

    fig, axes = plt.subplots(1, len(memory), figsize=(4.5 * len(memory), 3.2), squeeze=False)
    for ax, (w, mem) in zip(axes[0], memory.items()):
        names = list(mem["allocators"])
        bars = ax.bar([LABELS[a] for a in names], [mem["allocators"][a]["saturated_batch_size"] for a in names],
                      color=[COLORS[a] for a in names])
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
        ax.set_ylabel("requests per step")
        ax.set_title(f"{w}: average batch size", fontsize=10)
        ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    files.append(_save(fig, out / "fig13_batch_size.png"))

    if engine:
        fig, axes = plt.subplots(1, len(engine), figsize=(5 * len(engine), 3.6), squeeze=False)
        for ax, (w, res) in zip(axes[0], engine.items()):
            bound = res["latency_bound_s_per_token"]
            for a, pts in res["sweep"].items():
                ax.plot([p["rate"] for p in pts], [p["mean_normalized_latency"] for p in pts], "o-",
                        color=COLORS[a], label=LABELS[a], ms=4)
            ax.axhline(bound, ls="--", color="grey", lw=1, label="latency bound")
            ax.set_ylim(0, 2.5 * bound)
            ax.set_xlabel("request rate (req/s)")
            ax.set_ylabel("normalized latency (s/token)")
            ax.set_title(f"{w} (lengths x{setup.length_scale:g})", fontsize=10)
        axes[0][0].legend(fontsize=7)
        fig.tight_layout()
        files.append(_save(fig, out / "fig12_latency_vs_rate.png"))

        fig, axes = plt.subplots(1, len(engine), figsize=(4.5 * len(engine), 3.2), squeeze=False)
        for ax, (w, res) in zip(axes[0], engine.items()):
            runs = res["block_size_ablation"]["runs"]
            ax.plot([r["block_size"] for r in runs], [r["mean_normalized_latency"] for r in runs], "o-",
                    color="tab:red")
            ax.set_xscale("log", base=2)
            ax.set_xlabel(f"block size (x{1 / setup.length_scale:g} at the paper's scale)")
            ax.set_ylabel("normalized latency (s/token)")
            ax.set_title(f"{w} at {res['block_size_ablation']['rate']:.3g} req/s", fontsize=10)
        fig.tight_layout()
        files.append(_save(fig, out / "fig18b_block_size.png"))
    plt.close("all")
    return files


def _save(fig, path: Path) -> str:
    fig.savefig(path, dpi=90)
    return str(path)


# ---- report ------------------------------------------------------------------------------------

def report(results: dict) -> str:
    lines = []
    for w, mem in results["memory"].items():
        lines.append(f"\n{w}, memory at the paper's scale ({mem['num_requests']} requests, mean "
                     f"{mem['mean_input']:.0f} in / {mem['mean_output']:.0f} out, {mem['kv_slots']} KV slots):")
        lines.append(f"  {'allocator':10s} {'token states':>12s} {'reserved':>9s} {'int.frag':>9s} {'ext.frag':>9s} "
                     f"{'free':>6s} {'batch':>7s} {'preempt':>8s}")
        for a, r in mem["allocators"].items():
            s = shares(r["saturated_memory"])
            lines.append(f"  {a:10s} {s['token_states']:12.1%} {s['reserved']:9.1%} "
                         f"{s['internal_fragmentation']:9.1%} {s['external_fragmentation']:9.1%} {s['free']:6.1%} "
                         f"{r['saturated_batch_size']:7.2f} {r['num_preemptions']:8d}")
    for w, res in results["engine"].items():
        t = res["trace"]
        lines.append(f"\n{w}, engine ({t['num_requests']} requests, mean {t['mean_input']:.1f} in / "
                     f"{t['mean_output']:.1f} out; latency bound {res['latency_bound_s_per_token']:.3f} s/token):")
        lines.append(f"  {'allocator':10s} {'steady req/s':>12s} {'burst req/s':>11s} {'batch':>6s} {'preempt':>8s} "
                     f"{'recomputed':>10s} {'token states':>12s} {'sust. req/s':>11s}"
                     "   (burst: all at once; batch, token states: '-' where every request fit at once)")
        for a, r in res["burst"].items():
            rate = res["sustainable_rate"][a]["rate"]
            waited = math.isfinite(r["saturated_batch_size"])
            batch = f"{r['saturated_batch_size']:.1f}" if waited else "-"
            tokens = f"{shares(r['saturated_memory'])['token_states']:.1%}" if waited else "-"
            lines.append(f"  {a:10s} {r['steady_throughput_rps']:12.3f} {r['throughput_rps']:11.3f} {batch:>6s} "
                         f"{r['num_preemptions']:8d} {r['num_recomputed_tokens']:10d} {tokens:>12s} "
                         f"{'-' if rate is None else f'{rate:.3f}':>11s}")
    for w, rs in results["ratios"].items():
        for a, r in rs.items():
            parts = [f"batch {r['batch_size']:.2f}x"]
            if "steady_throughput" in r:
                sr, at_least = r["sustainable_rate"], ">=" if r["sustainable_rate_at_least"] else ""
                parts += [f"sustained rate {'n/a' if sr is None else f'{at_least}{sr:.2f}x'} (the paper's measure)",
                          f"steady throughput {r['steady_throughput']:.2f}x",
                          f"burst drain {r['burst_throughput']:.2f}x"]
            lines.append(f"{w:8s} paged vs {a:6s}: " + ", ".join(parts))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a smoke run (< 3 min)")
    p.add_argument("--sweep", action="store_true",
                   help="the engine's whole rate sweep sized for a 2-core machine (~30 min quiet; see sweep_setup)")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"), help="output directory")
    p.add_argument("--model", default=None, help="model path (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--length-scale", type=float, default=1 / 8, help="engine runs: lengths vs the paper's")
    p.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=None,
                   help="workloads for the engine runs (the memory simulation always does both)")
    p.add_argument("--allocators", nargs="+", choices=list(ALLOCATORS), default=None)
    p.add_argument("--num-requests", type=int, default=None, help="requests per engine trace")
    p.add_argument("--memory-requests", type=int, default=None, help="requests per memory simulation")
    p.add_argument("--rate-fractions", type=float, nargs="+", default=None,
                   help="request rates as fractions of the highest steady throughput of any allocator")
    p.add_argument("--block-sizes", type=int, nargs="+", default=None)
    p.add_argument("--latency-bound-factor", type=float, default=None)
    p.add_argument("--no-engine", action="store_true", help="only the memory simulation (seconds)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--simulate", default=None, metavar="DEVICE",
                   help="simulate on a device preset (a100-40gb, a100-80gb, h100, h200) instead of running the engine")
    p.add_argument("--model-preset", default="opt-13b", help="with --simulate: a model of models/presets.py")
    p.add_argument("--tp", type=int, default=None, help="with --simulate: GPUs (default: the paper's for the model)")
    p.add_argument("--sim-size", choices=["quick", "medium", "full"], default="full",
                   help="with --simulate: trace sizes (quick = --quick; medium: 500/1000 requests, ~3 min of CPU each)")
    args = p.parse_args(argv)
    if args.simulate:
        return simulate_main(args, argv)

    setup = quick_setup() if args.quick else sweep_setup() if args.sweep else full_setup(args.length_scale)
    if args.workloads:
        setup.engine_workloads = args.workloads
        setup.engine_requests = {w: setup.engine_requests.get(w, 64) for w in args.workloads}
    if args.allocators:
        setup.allocators = ["paged"] + [a for a in args.allocators if a != "paged"]
    if args.num_requests:
        setup.engine_requests = {w: args.num_requests for w in setup.engine_workloads}
    if args.memory_requests:
        setup.memory_requests = {w: args.memory_requests for w in setup.workloads}
    if args.rate_fractions:
        setup.rate_fractions = sorted(args.rate_fractions)
    if args.block_sizes:
        setup.block_sizes = args.block_sizes
    if args.latency_bound_factor:
        setup.latency_bound_factor = args.latency_bound_factor
    if args.no_engine:
        setup.engine_workloads = []
    setup.seed = args.seed
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    log = lambda msg: print(msg, flush=True)  # noqa: E731
    t0 = time.perf_counter()
    results: dict = {"memory": {w: run_memory(setup, w, log) for w in setup.workloads}, "engine": {}}
    data = {"command": " ".join(["python benchmarks/paper.py", *(sys.argv[1:] if argv is None else argv)]),
            "setup": {**dataclasses.asdict(setup), "max_model_len": setup.max_model_len,
                      "block_size": setup.block_size, "kv_slots": setup.kv_slots},
            "paper": PAPER}
    if setup.engine_workloads:
        base = load_base_engine(args.model, args.dtype, setup)
        log(f"model loaded in {time.perf_counter() - t0:.0f}s; engine runs: max_model_len {setup.max_model_len}, "
            f"block size {setup.block_size}, KV cache {setup.kv_slots} slots")
        data.update(model=base.model_path, dtype=str(base.dtype))
        warm_up(base, setup)
        results["engine"] = {w: run_engine(base, setup, w, log) for w in setup.engine_workloads}
    results["ratios"] = {w: ratios(results["memory"][w], results["engine"].get(w)) for w in setup.workloads}
    data.update(results=results, total_wall_s=time.perf_counter() - t0)
    (out / "paper.json").write_text(json.dumps(_finite(data), indent=1))
    files = plot(results, setup, out)
    print(report(results))
    print(f"\nwrote {out / 'paper.json'}, " + ", ".join(Path(f).name for f in files)
          + f" in {time.perf_counter() - t0:.0f}s")
    return 0


def simulate_main(args, argv) -> int:
    import logging

    from benchmarks.paper_sim import plot as plot_sim
    from benchmarks.paper_sim import report as report_sim
    from benchmarks.paper_sim import run_simulation
    logging.getLogger("pagedserve.scheduler").setLevel(logging.ERROR)   # preemption warnings: counted instead
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    validation = out / "sim_validation.json"     # sim_validate.py's output, here or in the default place
    if not validation.exists():
        validation = Path(__file__).resolve().parent / "results" / "sim_validation.json"
    data = run_simulation(args.simulate, args.model_preset, "quick" if args.quick else args.sim_size, args.tp, out,
                          lambda msg: print(msg, flush=True), validation)
    data["command"] = " ".join(["python benchmarks/paper.py", *(sys.argv[1:] if argv is None else argv)])
    (out / "paper_sim.json").write_text(json.dumps(_finite(data), indent=1))
    files = plot_sim(data, out)
    print(report_sim(data))
    print(f"\nwrote {out / 'paper_sim.json'}, " + ", ".join(Path(f).name for f in files)
          + f" in {time.perf_counter() - t0:.0f}s")
    return 0


def _finite(x):
    """JSON has no inf/nan: write them as strings."""
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


if __name__ == "__main__":
    sys.exit(main())
