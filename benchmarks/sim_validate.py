"""Validation before belief: the step-time simulator's `local` preset against the engine's
own runs on this machine.

    python benchmarks/sim_validate.py [--quick] [--out DIR]

1. The `local` preset's rates are measured here (pagedserve/sim/local.py: matmul and memory
   bandwidth in the engine's dtype); its per-step overhead is one engine step decoding one
   sequence, less the cost model's kernel time for that step (a separate one-request run).
2. The engine (paged) serves the paper benchmark's engine traces (benchmarks/paper.py: the
   ShareGPT-like and Alpaca-like workloads, lengths scaled) all at once and at two Poisson
   rates (half and 0.9 of its measured saturation throughput); every step's wall time and
   what it computed are recorded.
3. The simulator serves the same traces with the `local` preset (the real scheduler again,
   the cost model for time). Reported per run: measured vs predicted total run time
   (`relative_error` = predicted / measured - 1) and per-step time (the cost model on the
   engine's own steps). The simulator is trusted only where |relative_error| <= 10%.
Writes DIR/sim_validation.json (read by paper.py --simulate) and DIR/local_device.json.
Timings: run it on a quiet machine.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import paper  # noqa: E402
from benchmarks.workloads import make_trace  # noqa: E402
from pagedserve.kernels import cpu  # noqa: E402
from pagedserve.kernels.cpu_ops import CpuOps  # noqa: E402
from pagedserve.sim import CostModel, ModelShape, SimConfig, SimRequest, StepWork, simulate  # noqa: E402
from pagedserve.sim.local import measure_local_device, save_local_device  # noqa: E402

TRUST_BOUND = 0.10
VALIDATION_REQUESTS = {"sharegpt": 128, "alpaca": 256}


def shape_of(engine) -> ModelShape:
    a = engine.model_args
    return ModelShape(name=str(engine.model_path), num_layers=a.num_layers, hidden_size=a.hidden_size,
                      num_heads=a.num_heads, num_kv_heads=a.num_kv_heads, head_dim=a.head_dim,
                      ffn_size=getattr(a, "intermediate_size", None) or a.ffn_dim,
                      gated_mlp=hasattr(a, "intermediate_size"), vocab_size=a.vocab_size,
                      tied_embeddings=a.tie_word_embeddings, dtype_bytes=engine.dtype.itemsize)


def record_steps(engine) -> tuple[list[StepWork], list[float]]:
    """Wrap this engine's schedule() and step() to record each step's work and wall time."""
    works: list[StepWork] = []
    walls: list[float] = []
    schedule, step = engine.scheduler.schedule, engine.step

    def recorded_schedule():
        out = schedule()
        works.append(StepWork.of(((s.start, s.num_new_tokens) for s in out.scheduled), len(out.sampled)))
        return out

    def timed_step():
        t0 = time.perf_counter()
        result = step()
        walls.append(time.perf_counter() - t0)
        return result

    engine.scheduler.schedule, engine.step = recorded_schedule, timed_step
    return works, walls


def step_overhead(base, setup, shape: ModelShape, device) -> float:
    """One sequence decoding: median engine step time less the cost model's kernel time."""
    engine = paper.engine_for(base, "paged", setup.block_size, setup.kv_slots)
    works, walls = record_steps(engine)
    trace = make_trace("alpaca", 1, 1, base.vocab_size, setup.max_model_len, scale=setup.length_scale)
    trace[0].output_len = 32
    paper.serve(engine, trace, "overhead", math.inf)
    cost = CostModel(shape, device)
    decode = [w - cost.step_time(k).total for k, w in zip(works, walls) if k.num_tokens == 1]
    return max(0.0, statistics.median(decode))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="the paper benchmark's --quick traces (a smoke run)")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--length-scale", type=float, default=1 / 8)
    p.add_argument("--num-requests", type=int, default=None)
    args = p.parse_args(argv)
    setup = paper.quick_setup() if args.quick else paper.full_setup(args.length_scale)
    if args.num_requests or not args.quick:   # validation needs no long traces: 128 / 256 requests by default
        setup.engine_requests = {w: args.num_requests or VALIDATION_REQUESTS[w] for w in setup.engine_workloads}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    base = paper.load_base_engine(args.model, args.dtype, setup)
    shape = shape_of(base)
    ops = base.runner.model.ops
    device = measure_local_device(base.dtype, linear=ops.linear,
                                  pack=cpu.pack_weight if isinstance(ops, CpuOps) else lambda w: w)
    device = device.with_efficiency(step_overhead_s=step_overhead(base, setup, shape, device))
    save_local_device(device, out / "local_device.json")
    print(f"local: matmul {device.matmul_flops / 1e9:.1f} GFLOP/s, memory {device.memory_bandwidth / 1e9:.1f} GB/s, "
          f"step overhead {device.efficiency.step_overhead_s * 1e3:.2f} ms", flush=True)
    cost = CostModel(shape, device)
    paper.warm_up(base, setup)
    runs = []
    for workload in setup.engine_workloads:
        n = setup.engine_requests[workload]
        capacity = None
        for fraction in (math.inf, 0.5, 0.9):
            rate = math.inf if math.isinf(fraction) else fraction * capacity
            trace = make_trace(workload, n, setup.seed, base.vocab_size, setup.max_model_len, rate,
                               scale=setup.length_scale)
            engine = paper.engine_for(base, "paged", setup.block_size, setup.kv_slots)
            works, walls = record_steps(engine)
            measured = paper.serve(engine, trace, workload, rate)
            capacity = capacity or measured.throughput_rps
            c = engine.config
            sim = simulate([SimRequest(r.prompt_token_ids, r.output_len, r.arrival_time) for r in trace],
                           SimConfig(num_blocks=setup.kv_slots // setup.block_size, block_size=setup.block_size,
                                     max_model_len=setup.max_model_len, max_num_seqs=c.max_num_seqs,
                                     max_num_batched_tokens=c.max_num_batched_tokens,
                                     admission_watermark=c.admission_watermark), cost)
            predicted_steps = [cost.step_time(w).total for w in works]
            step_errors = [pr / m - 1 for pr, m in zip(predicted_steps, walls)]
            run = {"workload": workload, "rate": rate, "num_requests": n,
                   "measured_total_s": measured.duration_s, "predicted_total_s": sim.duration_s,
                   "relative_error": sim.duration_s / measured.duration_s - 1,
                   "measured_steps": len(walls), "predicted_steps": sim.num_steps,
                   "measured_step_mean_s": sum(walls) / len(walls),
                   "predicted_step_mean_s": sum(predicted_steps) / len(predicted_steps),
                   "step_relative_error_median": statistics.median(step_errors),
                   "step_relative_error_mean_abs": sum(abs(e) for e in step_errors) / len(step_errors)}
            run["trusted"] = abs(run["relative_error"]) <= TRUST_BOUND
            runs.append(run)
            print(f"  {workload:8s} {rate:8.3f} req/s: measured {run['measured_total_s']:.2f} s, predicted "
                  f"{run['predicted_total_s']:.2f} s ({run['relative_error']:+.1%}); per step "
                  f"{run['measured_step_mean_s'] * 1e3:.2f} vs {run['predicted_step_mean_s'] * 1e3:.2f} ms "
                  f"(median error {run['step_relative_error_median']:+.1%})", flush=True)
    worst = max(runs, key=lambda r: abs(r["relative_error"]))
    data = {"status": "measured", "command": " ".join(["python benchmarks/sim_validate.py",
                                                       *(sys.argv[1:] if argv is None else argv)]),
            "relative_error": worst["relative_error"], "relative_error_note": "the run with the largest |error|",
            "trust_bound": TRUST_BOUND, "local_device": {**{k: v for k, v in device.__dict__.items()
                                                            if k != "efficiency"},
                                                         "efficiency": device.efficiency.__dict__},
            "model": str(base.model_path), "dtype": str(base.dtype), "runs": runs,
            "wall_s": time.perf_counter() - t0}
    (out / "sim_validation.json").write_text(json.dumps(paper._finite(data), indent=1))
    print("\n| workload | rate (req/s) | measured s | predicted s | error | per-step ms (meas / pred) | trusted |")
    print("|---|---|---|---|---|---|---|")
    for r in runs:
        print(f"| {r['workload']} | {r['rate']:.3f} | {r['measured_total_s']:.2f} | {r['predicted_total_s']:.2f} | "
              f"{r['relative_error']:+.1%} | {r['measured_step_mean_s'] * 1e3:.2f} / "
              f"{r['predicted_step_mean_s'] * 1e3:.2f} | {'yes' if r['trusted'] else 'no'} |")
    print(f"\nwrote {out / 'sim_validation.json'} in {time.perf_counter() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
