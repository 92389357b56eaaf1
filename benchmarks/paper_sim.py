"""The paper's figures in its own regime, on the step-time simulator (pagedserve/sim).

    python benchmarks/paper.py --simulate a100-40gb --model-preset opt-13b [--quick | --sim-size medium] [--out DIR]

The real scheduler and KV managers (paged, and the paper's Orca baselines: Oracle, Pow2,
Max) serve long ShareGPT-like and Alpaca-like traces on a simulated clock, the model step
replaced by the step-time model (sim/cost.py: a roofline term per class of work on the chosen
GPU preset, the paged kernel's published penalty on the paged cache only) and the model's shape
(configs only, no weights).
The paper's setup: 2048-token context, 16-token blocks, the KV cache that the GPUs' memory
leaves after the weights (90% of it; 15.8k slots for OPT-13B on an A100-40GB, the paper's
15.7k), OPT-66B on 4 GPUs and OPT-175B on 8 (tensor parallel).

Per workload:
1. saturation (every request at t=0): steady-state throughput (10% to 90% of finishes);
   the capacity of each allocator;
2. a rate sweep, geometric from half the lowest capacity to twice the highest:
   normalized latency (mean over requests of latency / output length, the paper's Fig. 12),
   and the highest rate each allocator sustains with it under a bound (a multiple of the
   paged allocator's latency at the lowest rate), as the paper reads Fig. 12;
3. (Fig. 14) parallel sampling n = 2, 4, 6 and beam search width 2, 4, 6 on the Alpaca-like
   trace: the paged cache's memory saving from sharing, and saturation throughput against the
   baselines (which run each sequence as a request of its own);
4. (Fig. 17) the chatbot workload: prompts are conversation histories cut to 1024 tokens,
   every request asks for 1024 tokens and answers with a ShareGPT-like length, so the
   baselines reserve 1024 output tokens while the paged cache holds what is generated;
   saturation and the rate sweep as in 1-2.
Preemptions and recomputed tokens are reported beside batch sizes. Every figure here is a
simulation: the time side is the cost model's, trusted only as far as the validation on this
machine (benchmarks/sim_validate.py) carries it.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.workloads import chatbot_lengths, make_trace, poisson_arrivals
from pagedserve.models.presets import PRESETS
from pagedserve.sim import (DEVICES, EFFICIENCY_SOURCES, CostModel, ModelShape, SimConfig, SimRequest, simulate,
                            sustained_rate)

ALLOCATORS = ("paged", "oracle", "pow2", "max")
LABELS = {"paged": "paged (vLLM)", "oracle": "Orca-Oracle", "pow2": "Orca-Pow2", "max": "Orca-Max"}
COLORS = {"paged": "tab:red", "oracle": "tab:blue", "pow2": "tab:green", "max": "tab:purple"}
PAPER_TP = {"opt-13b": 1, "opt-66b": 4, "opt-175b": 8, "llama-13b": 1}
# The paper's ratios of sustained request rates (Kwon et al., SOSP 2023, Sec. 6.2, Fig. 12), as
# the paper states them: across OPT-13B/66B/175B on ShareGPT; on Alpaca the advantage is smaller.
PAPER_RATIOS = {"sharegpt": {"oracle": "1.7-2.7x", "max": "2.7-8x"},
                "alpaca": {"oracle": "smaller than on ShareGPT", "max": "smaller than on ShareGPT"},
                # Sec. 6.5, Fig. 17 (OPT-13B): the baselines reserve 1024 output tokens, whatever they predict.
                "chatbot": {"oracle": "2x", "pow2": "2x", "max": "2x"}}
# Sec. 6.3: memory saved by sharing on Alpaca, parallel sampling and beam search (widths 2-6).
PAPER_FIG14_SAVING = {"parallel": "6.1-9.8%", "beam": "37.6-55.2%"}
MAX_MODEL_LEN, BLOCK_SIZE = 2048, 16


@dataclass
class SimSetup:
    num_requests: dict[str, int]
    num_rates: int
    fig14_requests: int
    chatbot_requests: int
    fig14_widths: list[int] = field(default_factory=lambda: [2, 4, 6])
    latency_bound_factor: float = 4.0
    seed: int = 0


def full_sim_setup() -> SimSetup:
    return SimSetup(num_requests={"sharegpt": 1000, "alpaca": 2000}, num_rates=10, fig14_requests=1000,
                    chatbot_requests=500)


def medium_sim_setup() -> SimSetup:
    """Long enough that memory binds on every model's cache (OPT-175B's 57k slots too) and a sustained
    rate is read on a backlog, short enough for ~3 min of CPU per model."""
    return SimSetup(num_requests={"sharegpt": 500, "alpaca": 1000}, num_rates=6, fig14_requests=300,
                    chatbot_requests=300, fig14_widths=[2, 4, 6])


def quick_sim_setup() -> SimSetup:
    return SimSetup(num_requests={"sharegpt": 150, "alpaca": 300}, num_rates=5, fig14_requests=150,
                    chatbot_requests=100, fig14_widths=[2, 6])


def _trace(workload: str, num_requests: int, rate: float, seed: int, vocab: int, **kw) -> list[SimRequest]:
    return [SimRequest(r.prompt_token_ids, r.output_len, r.arrival_time, **kw)
            for r in make_trace(workload, num_requests, seed, vocab, MAX_MODEL_LEN, rate)]


def _chatbot_trace(num_requests: int, rate: float, seed: int) -> list[SimRequest]:
    """Every request asks for 1024 tokens and answers with its traced length (EOS)."""
    lengths = chatbot_lengths(num_requests, seed)
    return [SimRequest([7] * p, o, t, max_tokens=1024)
            for (p, o), t in zip(lengths, poisson_arrivals(num_requests, rate, seed))]


def run_workload(workload: str, setup: SimSetup, costs: dict[str, CostModel], num_blocks: int, vocab: int, log,
                 make=None) -> dict:
    """Saturation, then the rate sweep, for every allocator. `make(rate)`: the trace (default:
    the workload's from benchmarks/workloads.py, setup.num_requests of them)."""
    n = setup.num_requests.get(workload, setup.chatbot_requests)
    make = make or (lambda rate: _trace(workload, n, rate, setup.seed, vocab))
    config = lambda a: SimConfig(kv_allocator=a, num_blocks=num_blocks, block_size=BLOCK_SIZE,  # noqa: E731
                                 max_model_len=MAX_MODEL_LEN, seed=setup.seed)
    saturation = {}
    for a in ALLOCATORS:
        t0 = time.perf_counter()
        r = simulate(make(math.inf), config(a), costs[a])
        saturation[a] = r.summary()
        log(f"  {workload:8s} {a:6s} saturation: {r.steady_throughput_rps:7.3f} req/s steady, batch "
            f"{r.avg_batch_size:5.1f}, {r.num_preemptions} preemptions  ({time.perf_counter() - t0:.0f}s)")
    caps = [saturation[a]["steady_throughput_rps"] for a in ALLOCATORS]
    lo, hi = 0.5 * min(caps), 2.0 * max(caps)
    rates = [lo * (hi / lo) ** (i / (setup.num_rates - 1)) for i in range(setup.num_rates)]
    sweep: dict[str, list[dict]] = {a: [] for a in ALLOCATORS}
    for rate in rates:
        trace = make(rate)
        for a in ALLOCATORS:
            r = simulate(trace, config(a), costs[a])
            sweep[a].append({"rate": rate, **r.summary()})
        log(f"  {workload:8s} {rate:7.3f} req/s: " + ", ".join(
            f"{a} {sweep[a][-1]['mean_normalized_latency']:.3f}" for a in ALLOCATORS) + " s/token")
    bound = setup.latency_bound_factor * sweep["paged"][0]["mean_normalized_latency"]
    sustained = {a: sustained_rate([(p["rate"], p["mean_normalized_latency"]) for p in pts], bound)
                 for a, pts in sweep.items()}
    return {"num_requests": n, "num_blocks": num_blocks, "saturation": saturation, "rates": rates,
            "latency_bound_s_per_token": bound, "sweep": sweep,
            "sustained_rate": {a: s["rate"] for a, s in sustained.items()},
            "sustained_rate_note": {a: s["note"] for a, s in sustained.items()}}


def run_fig14(setup: SimSetup, costs: dict[str, CostModel], num_blocks: int, vocab: int, log) -> dict:
    """Parallel sampling and beam search on the Alpaca-like trace, all at once: the paged cache's
    memory saving from sharing, and saturation throughput against the baselines. The baselines
    cannot share blocks, so each of a request's `width` sequences runs as a request of its own
    with its own reservation (for beam search an approximation: no beams fork or end early)."""
    out: dict[str, list[dict]] = {"parallel": [], "beam": []}
    n = setup.fig14_requests
    for kind in out:
        for w in setup.fig14_widths:
            kw = {"n": w} if kind == "parallel" else {"beam_width": w}
            config = lambda a: SimConfig(kv_allocator=a, num_blocks=num_blocks, block_size=BLOCK_SIZE,  # noqa: E731
                                         max_model_len=MAX_MODEL_LEN, seed=setup.seed)
            r = simulate(_trace("alpaca", n, math.inf, setup.seed, vocab, **kw), config("paged"), costs["paged"])
            point = {"width": w, **r.summary(), "throughput_rps_by_allocator": {"paged": r.steady_throughput_rps}}
            split = [q for q in _trace("alpaca", n, math.inf, setup.seed, vocab) for _ in range(w)]
            for a in ALLOCATORS[1:]:
                b = simulate(split, config(a), costs[a])
                point["throughput_rps_by_allocator"][a] = b.steady_throughput_rps / w   # requests of w sequences
            out[kind].append(point)
            log(f"  alpaca {kind:8s} {w}: sharing saves {r.sharing_saving_avg:.1%} of blocks; req/s " + ", ".join(
                f"{a} {v:.2f}" for a, v in point["throughput_rps_by_allocator"].items()))
    return out


def run_simulation(device_name: str, model_preset: str, size: str | bool, tp: int | None, out: Path, log,
                   validation_path: Path) -> dict:
    """size: "quick", "medium" or "full" (True: quick, False: full)."""
    size = {True: "quick", False: "full"}.get(size, size)
    setup = {"quick": quick_sim_setup, "medium": medium_sim_setup, "full": full_sim_setup}[size]()
    quick = size != "full"
    shape = ModelShape.preset(model_preset)
    device = DEVICES[device_name]
    tp = tp or PAPER_TP.get(model_preset, 1)
    # The paged cache runs the paged attention kernel (the preset's paged/contiguous penalty), the
    # baselines the contiguous one: the same step-time model otherwise.
    costs = {a: CostModel(shape, device, tp, paged=a == "paged", block_size=BLOCK_SIZE) for a in ALLOCATORS}
    slots = costs["paged"].kv_cache_tokens()
    num_blocks = slots // BLOCK_SIZE
    vocab = PRESETS[model_preset]["vocab_size"]
    log(f"simulating {model_preset} on {tp} x {device_name}: {shape.weight_bytes / 1e9:.1f} GB of weights, "
        f"{slots} KV slots ({num_blocks} blocks of {BLOCK_SIZE})")
    t0 = time.perf_counter()
    workloads = {w: run_workload(w, setup, costs, num_blocks, vocab, log) for w in ("sharegpt", "alpaca")}
    for res in workloads.values():
        _add_ratios(res)
    fig14 = run_fig14(setup, costs, num_blocks, vocab, log)
    chatbot = run_workload("chatbot", setup, costs, num_blocks, vocab, log,
                           make=lambda rate: _chatbot_trace(setup.chatbot_requests, rate, setup.seed))
    _add_ratios(chatbot)
    validation = (json.loads(validation_path.read_text()) if validation_path.exists() else
                  {"status": "not run here", "relative_error": None,
                   "command": "python benchmarks/sim_validate.py (on a quiet machine)"})
    return {"device": device_name, "model_preset": model_preset, "tp": tp, "quick": quick, "size": size,
            "device_preset": {k: v for k, v in device.__dict__.items() if k != "efficiency"},
            "efficiency": device.efficiency.__dict__, "efficiency_sources": EFFICIENCY_SOURCES,
            "kv_slots": slots, "block_size": BLOCK_SIZE, "max_model_len": MAX_MODEL_LEN, "setup": setup.__dict__,
            "paper_ratios": PAPER_RATIOS, "paper_fig14_saving": PAPER_FIG14_SAVING, **workloads, "fig14": fig14,
            "chatbot": chatbot,
            "validation": {k: validation.get(k) for k in ("status", "passed", "mutation_check_passed", "relative_error",
                                                          "command", "runs", "terms") if k in validation},
            "wall_s": time.perf_counter() - t0}


def _add_ratios(res: dict) -> None:
    """paged / baseline: sustained rates (None where a rate was not found) and saturation throughput."""
    rates, sat = res["sustained_rate"], res["saturation"]
    res["sustained_rate_ratio"] = {a: (rates["paged"] / rates[a] if rates["paged"] and rates[a] else None)
                                   for a in ALLOCATORS if a != "paged"}
    res["saturation_throughput_ratio"] = {a: sat["paged"]["steady_throughput_rps"] / sat[a]["steady_throughput_rps"]
                                          for a in ALLOCATORS if a != "paged"}


def plot(data: dict, out: Path) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    tag = f"{data['model_preset']}_{data['device']}"
    files = []
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.6))
    for ax, w in zip(axes, ("sharegpt", "alpaca", "chatbot")):
        res = data[w]
        bound = res["latency_bound_s_per_token"]
        for a, pts in res["sweep"].items():
            ax.plot([p["rate"] for p in pts], [p["mean_normalized_latency"] for p in pts], "o-", color=COLORS[a],
                    label=LABELS[a], ms=3)
        ax.axhline(bound, ls="--", color="grey", lw=1, label="latency bound")
        ax.set_ylim(0, 2.5 * bound)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("normalized latency (s/token)")
        ax.set_title(f"{w}, {data['model_preset']} on {data['tp']}x {data['device']} (simulated)", fontsize=9)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    files.append(_save(fig, out / f"sim_fig12_{tag}.png"))
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    for ax, kind in zip(axes, ("parallel", "beam")):
        pts = data["fig14"][kind]
        bars = ax.bar([str(p["width"]) for p in pts], [100 * p["sharing_saving_avg"] for p in pts], color="tab:red")
        ax.bar_label(bars, fmt="%.1f%%", fontsize=8)
        ax.set_xlabel("parallel size n" if kind == "parallel" else "beam width")
        ax.set_ylabel("memory saving (%)")
        ax.set_title(f"alpaca, {kind} (simulated)", fontsize=9)
    fig.tight_layout()
    files.append(_save(fig, out / f"sim_fig14_{tag}.png"))
    plt.close("all")
    return files


def _save(fig, path: Path) -> str:
    fig.savefig(path, dpi=90)
    return str(path)


def report(data: dict) -> str:
    lines = [f"\nSimulated: {data['model_preset']} on {data['tp']} x {data['device']}, {data['kv_slots']} KV slots",
             "| workload | allocator | saturation req/s | batch | preemptions | recomputed tokens | sustained req/s "
             "| paged / this (sustained) | paper |", "|---|---|---|---|---|---|---|---|---|"]
    for w in ("sharegpt", "alpaca", "chatbot"):
        res = data[w]
        for a in ALLOCATORS:
            s = res["saturation"][a]
            rate = res["sustained_rate"][a]
            ratio = res["sustained_rate_ratio"].get(a)
            lines.append(f"| {w} | {a} | {s['steady_throughput_rps']:.3f} | {s['avg_batch_size']:.1f} | "
                         f"{s['num_preemptions']} | {s['num_recomputed_tokens']} | "
                         f"{'-' if rate is None else f'{rate:.3f}'} | {'-' if ratio is None else f'{ratio:.2f}x'} | "
                         f"{PAPER_RATIOS[w].get(a, '-')} |")
    lines.append("\n| Fig. 14 (alpaca, all at once) | width | memory saving (paper) | saturation req/s: paged / oracle "
                 "/ pow2 / max |\n|---|---|---|---|")
    for kind, pts in data["fig14"].items():
        for p in pts:
            by = p["throughput_rps_by_allocator"]
            lines.append(f"| {kind} | {p['width']} | {p['sharing_saving_avg']:.1%} ({PAPER_FIG14_SAVING[kind]}) | "
                         + " / ".join(f"{by[a]:.3f}" for a in ALLOCATORS) + " |")
    v = data["validation"]
    lines.append(f"\nvalidation (local preset vs this machine): {v.get('status', '')}, passed {v.get('passed')}, "
                 f"mutation check {v.get('mutation_check_passed')}, worst total error {v.get('relative_error')}")
    return "\n".join(lines)
