"""Validation before belief: the step-time simulator's `local` preset against the engine's own
steps on this machine, judged per step.

    python benchmarks/sim_validate.py --calibrate [--quick | --tiny] [--out DIR]

1. `--calibrate`: micro-benchmarks of the engine's own kernels (pagedserve/sim/local.py: linear
   layers by shape, paged attention by batch, context and block size against the contiguous
   layout, prefill attention, element-wise kernels by tokens, the LM head, the sampler; written
   to DIR/local_device_micro.json), then a calibration engine run (Alpaca-like, saturated,
   its own seed) and a decomposed engine run (the layer loop in Python, each op timed:
   prefill-only steps, then decode-only steps at every batch size from 48 down to 1). Every
   term is then rescaled to what it took inside those runs' steps (local.py `fit_in_steps`:
   the micro-benchmarks run hot caches, one op at a time; real steps run each layer's weights
   after 29 other layers' and pay the layer loop), the linear and element-wise terms carried
   over from the decomposed run's Python layer loop to the calibration run's (compiled) one by
   loop factors, and the step cost outside the model is fit on the calibration run; writes
   DIR/local_device.json. Without it, that file is read. The
   eight validation runs below are never fit on.
2. The term checks, per step: linear, decode attention (decode-only steps), prefill attention
   (prefill-only steps), element-wise (the forward less linear and attention) on the decomposed
   run (what the fit used: a check of the fit); the LM head, sampling and the step cost outside
   the model on every step of the validation runs (held out). A term is trusted where the
   median over steps of predicted / measured - 1 is within TERM_BOUND.
3. The engine (paged) serves two workloads (ShareGPT-like, long contexts; Alpaca-like, many
   short requests) at two block sizes, saturated (every request at t=0, the KV cache binding,
   preemptions happening) and below saturation (Poisson at BELOW_FRACTION of the saturated
   run's throughput); every step's wall time and work is recorded (StepRecorder:
   LLMEngine.step_observers). The cost model prices the engine's own steps (per-step error:
   median and p90 of |error|), and the simulator serves the same trace with the real scheduler
   (step counts, total time).
4. Trusted only if: on saturated runs |median step error| <= STEP_MEDIAN_BOUND and p90 of
   |step error| <= STEP_P90_BOUND; on every run |total error| <= TOTAL_BOUND; every term
   within TERM_BOUND. Mutation check: each term scaled by 1.5 must make this verdict fail.
Writes DIR/sim_validation.json (read by paper.py --simulate). Timings: a quiet machine only.
`--record-steps FILE` also writes every step of the calibration, decomposed and validation runs,
so that a cost model can be evaluated (or refit) offline: benchmarks/sim_fit.py.
Expected with --calibrate on a quiet 2-core machine: about 10 minutes (598 s before the in-step
fit, which adds about 10 s of decode steps to the decomposed run; --quick: about 3).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import paper  # noqa: E402
from benchmarks.workloads import make_trace  # noqa: E402
from pagedserve.config import EngineConfig  # noqa: E402
from pagedserve.engine.llm_engine import LLMEngine  # noqa: E402
from pagedserve.sim import CostModel, ModelShape, SimConfig, SimRequest, simulate  # noqa: E402
from pagedserve.sim.cost import TERMS  # noqa: E402
from pagedserve.sim.local import (CalibrationSizes, StepRecorder, fit_in_steps, fit_step_cost,  # noqa: E402
                                  load_local_device, local_device, measure_kernels, save_local_device, with_step_cost)

STEP_MEDIAN_BOUND, STEP_P90_BOUND, TOTAL_BOUND, TERM_BOUND = 0.10, 0.15, 0.10, 0.15
BELOW_FRACTION = 0.6
MUTATION = 1.5
DOMINANT = 0.8    # a term checked on steps where it is this share of its kernel's predicted time


@dataclass
class Workload:
    name: str
    scale: float          # of the trace's lengths (benchmarks/workloads.py)
    num_requests: int
    kv_slots: int         # small enough that the KV cache binds at saturation (preemptions)


@dataclass
class ValidationSetup:
    workloads: list[Workload]
    block_sizes: list[int] = field(default_factory=lambda: [2, 16])
    max_model_len: int = 512
    calibration: CalibrationSizes = field(default_factory=CalibrationSizes)
    calibration_requests: int = 96      # the step-cost fit's engine run
    decomposed_requests: int = 48       # the per-term run (prompts of decomposed_prompt tokens)
    decomposed_prompt: int = 200
    decomposed_output: int = 24
    seed: int = 0


def full_setup() -> ValidationSetup:
    return ValidationSetup([Workload("sharegpt", 1 / 4, 160, 6144), Workload("alpaca", 1.0, 256, 3072)])


def quick_setup() -> ValidationSetup:
    return ValidationSetup([Workload("sharegpt", 1 / 4, 64, 3072), Workload("alpaca", 1.0, 96, 1536)],
                           calibration=CalibrationSizes.quick(), calibration_requests=48, decomposed_requests=24)


def tiny_setup() -> ValidationSetup:
    """Checks that everything runs (numbers meaningless)."""
    return ValidationSetup([Workload("sharegpt", 1 / 16, 6, 256), Workload("alpaca", 1 / 4, 8, 128)],
                           max_model_len=128, calibration=CalibrationSizes.tiny(), calibration_requests=6,
                           decomposed_requests=6, decomposed_prompt=40, decomposed_output=4)


def shape_of(engine) -> ModelShape:
    a = engine.model_args
    return ModelShape(name=str(engine.model_path), num_layers=a.num_layers, hidden_size=a.hidden_size,
                      num_heads=a.num_heads, num_kv_heads=a.num_kv_heads, head_dim=a.head_dim,
                      ffn_size=getattr(a, "intermediate_size", None) or a.ffn_dim,
                      gated_mlp=hasattr(a, "intermediate_size"), vocab_size=a.vocab_size,
                      tied_embeddings=a.tie_word_embeddings, dtype_bytes=engine.dtype.itemsize)


def record_run(base: LLMEngine, trace, block_size: int, kv_slots: int, workload: str, rate: float,
               ops: bool = False):
    engine = paper.engine_for(base, "paged", block_size, kv_slots)
    model = engine.runner.model
    compiled = model.compiled_layers
    if ops:
        model.compiled_layers = None        # the Python layer loop, each op timed
    recorder = StepRecorder(engine, ops=ops)
    try:
        result = paper.serve(engine, trace, workload, rate)
    finally:
        records = recorder.close()
        model.compiled_layers = compiled
    return engine, result, records


def _rel(pred: float, meas: float) -> float:
    return pred / meas - 1 if meas > 0 else math.inf


def _p90(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(math.ceil(0.9 * len(xs))) - 1)] if xs else math.nan


def term_checks(cost: CostModel, decomposed, compiled) -> dict:
    """Median over steps of predicted / measured - 1, per term, where the term is what the step did."""
    def check(pairs):
        errs = [_rel(p, m) for p, m in pairs if m > 0]
        med = statistics.median(errs) if errs else math.nan
        return {"median_error": med, "steps": len(errs), "ok": bool(errs) and abs(med) <= TERM_BOUND}
    cal = cost.device.calibration
    # The decomposed run's own layer loop (the Python one): without the factor that carries the
    # linear and element-wise terms over to the validated engine's loop (the same term scales).
    python_loop = cost if not (cal and cal.loop_factors) else CostModel(
        cost.model, dataclasses.replace(cost.device, calibration=dataclasses.replace(cal, loop_factors=[])),
        tp=cost.tp, paged=cost.paged, block_size=cost.block_size, term_scale=cost.term_scale)
    t_dec = [(r, python_loop.step_time(r.work)) for r in decomposed]
    t_all = [(r, cost.step_time(r.work)) for r in compiled]
    # The Python layer loop pays one call per op per layer that the compiled loop does not (the
    # calibration took it out): 4 linear, 1 attention, 5 element-wise (two norms, RoPE, SiLU, KV write).
    per_call = cost.model.num_layers * (cal.call_overhead_s if cal else 0.0)

    def attention(share_of):     # decodes and prefills run in one kernel call: steps that one of them dominates
        return check([(t.decode_attention + t.prefill_attention + per_call, r.ops_s.get("attention", 0))
                      for r, t in t_dec
                      if getattr(t, share_of) >= DOMINANT * (t.decode_attention + t.prefill_attention) > 0])
    return {
        "linear": check([(t.linear + 4 * per_call, r.ops_s.get("linear", 0)) for r, t in t_dec]),
        "decode_attention": attention("decode_attention"),
        "prefill_attention": attention("prefill_attention"),
        # Element-wise: all of the forward that is not a linear layer or attention (the norms, RoPE,
        # SiLU, KV write and the layer loop between the ops).
        "elementwise": check([(t.elementwise + 6 * per_call, r.forward_s - r.ops_s.get("linear", 0)
                               - r.ops_s.get("attention", 0)) for r, t in t_dec]),
        "lm_head": check([(t.lm_head, r.lm_head_s) for r, t in t_all if r.work.num_sampled]),
        "sampling": check([(t.sampling, r.sampler_s) for r, t in t_all if r.work.num_sampled]),
        "overhead": check([(t.overhead, r.outside_kernels_s) for r, t in t_all]),
    }


def evaluate(cost_for, runs: list[dict], decomposed, log=None) -> dict:
    """The verdict for one cost model (cost_for(block_size) -> CostModel) over the recorded runs."""
    out_runs = []
    for run in runs:
        cost = cost_for(run["block_size"])
        records = run["records"]
        pred = [cost.step_time(r.work).total for r in records]
        errs = [_rel(p, r.wall_s) for p, r in zip(pred, records)]
        sim = simulate(run["sim_trace"], run["sim_config"], cost)
        measured = run["result"]
        res = {k: run[k] for k in ("workload", "block_size", "rate", "saturated", "num_requests")}
        res.update(measured_total_s=measured.duration_s, predicted_total_s=sim.duration_s,
                   total_error=_rel(sim.duration_s, measured.duration_s), measured_steps=len(records),
                   predicted_steps=sim.num_steps, measured_preemptions=measured.num_preemptions,
                   predicted_preemptions=sim.num_preemptions, measured_batch=measured.avg_batch_size,
                   predicted_batch=sim.avg_batch_size,
                   measured_step_mean_s=statistics.fmean(r.wall_s for r in records),
                   predicted_step_mean_s=statistics.fmean(pred),
                   step_error_median=statistics.median(errs), step_error_p90_abs=_p90([abs(e) for e in errs]))
        ok = abs(res["total_error"]) <= TOTAL_BOUND
        if run["saturated"]:
            ok = ok and abs(res["step_error_median"]) <= STEP_MEDIAN_BOUND and \
                res["step_error_p90_abs"] <= STEP_P90_BOUND
        res["ok"] = ok
        out_runs.append(res)
    cost16 = cost_for(16)
    terms = term_checks(cost16, decomposed, [r for run in runs for r in run["records"]])
    passed = all(r["ok"] for r in out_runs) and all(t["ok"] for t in terms.values())
    return {"passed": passed, "runs": out_runs, "terms": terms}


def calibrate(base: LLMEngine, setup: ValidationSetup, shape: ModelShape, log):
    t0 = time.perf_counter()
    cal = measure_kernels(base, setup.calibration, log)
    device = local_device(cal)
    trace = make_trace("alpaca", setup.calibration_requests, setup.seed + 1000, base.vocab_size,
                       setup.max_model_len, scale=setup.workloads[-1].scale)
    _, _, records = record_run(base, trace, 16, setup.workloads[-1].kv_slots, "calibration", math.inf)
    device = with_step_cost(device, fit_step_cost(records))
    log(f"calibrated in {time.perf_counter() - t0:.0f}s: step cost {device.calibration.step[0] * 1e3:.2f} ms + "
        f"{device.calibration.step[1] * 1e6:.1f} us/seq + {device.calibration.step[2] * 1e6:.2f} us/token; "
        f"one op call {device.calibration.call_overhead_s * 1e6:.1f} us; paged/contiguous decode attention "
        "(64 seqs x 256): " + ", ".join(f"bs {b}: {device.calibration.paged_penalty(int(b)):.2f}x"
                                       for b in device.calibration.decode_attention))
    return device, records


def fit_device(device, decomposed, calibration_steps, shape: ModelShape, compiled_loop: bool):
    """The micro-benchmarked preset rescaled to the calibration and decomposed engine runs'
    steps (sim/local.py fit_in_steps); never the validation runs."""
    cal = device.calibration
    if "in_step_fit" in cal.meta:
        raise ValueError("this preset is already fitted to engine steps: refit the micro-benchmarks' "
                         "(local_device_micro.json)")
    fitted = fit_in_steps(cal, shape.num_layers, decomposed, calibration_steps,
                          per_call_s=cal.call_overhead_s if compiled_loop else 0.0)
    # The fitted terms hold the per-op call (the Python loop: call_overhead_s 0) or had it taken out
    # (the compiled loop: the term checks add it back where they compare with the decomposed run).
    return dataclasses.replace(device, calibration=dataclasses.replace(fitted, call_overhead_s=cal.call_overhead_s
                                                                      if compiled_loop else 0.0,
                                                                      meta={**fitted.meta,
                                                                            "micro_call_overhead_s":
                                                                                cal.call_overhead_s}))


def decomposed_trace(setup: ValidationSetup, vocab: int):
    """Prefill-only steps (long prompts at once), then decode-only steps at every batch size
    from all the requests down to one (request i generates decomposed_output + i tokens), so the
    in-step fit sees each row count the kernels may switch paths at."""
    trace = make_trace("alpaca", setup.decomposed_requests, setup.seed + 2000, vocab, setup.max_model_len)
    for i, r in enumerate(trace):
        r.prompt_token_ids = (r.prompt_token_ids * setup.decomposed_prompt)[:setup.decomposed_prompt]
        r.output_len = setup.decomposed_output + i
    return trace


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calibrate", action="store_true", help="measure the local preset first (else read it)")
    p.add_argument("--quick", action="store_true", help="fewer requests and calibration points (about 2.5 min)")
    p.add_argument("--tiny", action="store_true", help="a check that it runs (numbers meaningless)")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--record-steps", default=None,
                   help="also write every recorded engine step (work, wall and kernel times) to this JSON file")
    args = p.parse_args(argv)
    setup = tiny_setup() if args.tiny else quick_setup() if args.quick else full_setup()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = lambda s: print(s, flush=True)  # noqa: E731
    t0 = time.perf_counter()
    base = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, max_model_len=setup.max_model_len,
                                  block_size=16, num_gpu_blocks_override=setup.workloads[0].kv_slots // 16,
                                  enable_prefix_caching=False, seed=setup.seed))
    shape = shape_of(base)
    device_path = out / "local_device.json"
    # The first steps pay one-time costs (allocations, kernel selection): keep them out.
    record_run(base, make_trace("sharegpt", 4, 12345, base.vocab_size, setup.max_model_len, scale=1 / 8), 16,
               setup.workloads[0].kv_slots, "warmup", math.inf)
    slots = setup.decomposed_requests * (setup.decomposed_prompt + setup.decomposed_output +
                                         setup.decomposed_requests + 16)
    calibration_steps = []
    if args.calibrate:
        micro, calibration_steps = calibrate(base, setup, shape, log)
        save_local_device(micro, out / "local_device_micro.json")
    else:
        device = load_local_device(device_path)
    _, _, decomposed = record_run(base, decomposed_trace(setup, base.vocab_size), 16, slots, "decomposed", math.inf,
                                  ops=True)
    if args.calibrate:
        device = fit_device(micro, decomposed, calibration_steps, shape,
                            compiled_loop=base.runner.model.compiled_layers is not None)
        save_local_device(device, device_path)
        fit = device.calibration.meta["in_step_fit"]
        log(f"in-step fit ({fit['decomposed_steps']} decomposed, {fit['calibration_steps']} calibration steps): "
            f"decode attention x{fit['decode_attention_factor'] or 1:.2f}, prefill attention "
            f"x{fit['prefill_attention_factor'] or 1:.2f}, linear x" +
            ", x".join(f"{f:.2f} at {int(n)}" for n, f in fit.get("linear_factors", [])[::8]))
    cost_for = lambda bs, **kw: CostModel(shape, device, block_size=bs, **kw)  # noqa: E731
    runs = []
    for w in setup.workloads:
        for bs in setup.block_sizes:
            capacity = None
            for saturated in (True, False):
                rate = math.inf if saturated else BELOW_FRACTION * capacity
                trace = make_trace(w.name, w.num_requests, setup.seed, base.vocab_size, setup.max_model_len, rate,
                                   scale=w.scale)
                engine, result, records = record_run(base, trace, bs, w.kv_slots, w.name, rate)
                capacity = capacity or result.throughput_rps
                c = engine.config
                runs.append({"workload": w.name, "block_size": bs, "rate": rate, "saturated": saturated,
                             "num_requests": w.num_requests, "result": result, "records": records,
                             "sim_trace": [SimRequest(r.prompt_token_ids, r.output_len, r.arrival_time) for r in trace],
                             "sim_config": SimConfig(num_blocks=w.kv_slots // bs, block_size=bs,
                                                     max_model_len=setup.max_model_len, max_num_seqs=c.max_num_seqs,
                                                     max_num_batched_tokens=c.max_num_batched_tokens,
                                                     admission_watermark=c.admission_watermark,
                                                     preemption_mode=c.preemption_mode)})
                log(f"  {w.name:8s} bs {bs:2d} {'saturated' if saturated else f'{rate:.2f} req/s'}: "
                    f"{result.duration_s:.1f}s, {len(records)} steps, {result.num_preemptions} preemptions")
    if args.record_steps:
        save_records(Path(args.record_steps), runs, decomposed, calibration_steps,
                     compiled_loop=base.runner.model.compiled_layers is not None)
    verdict = evaluate(cost_for, runs, decomposed)
    mutations = {}
    for term in TERMS:
        if term == "allreduce":
            mutations[term] = {"applies": False, "note": "no tensor parallelism on the local preset"}
            continue
        v = evaluate(lambda bs, t=term: cost_for(bs, term_scale={t: MUTATION}), runs, decomposed)
        mutations[term] = {"applies": True, "validation_failed": not v["passed"],
                           "failed_checks": [f"{r['workload']} bs {r['block_size']} "
                                             f"{'saturated' if r['saturated'] else 'below'}"
                                             for r in v["runs"] if not r["ok"]] +
                                            [f"term {k}" for k, t in v["terms"].items() if not t["ok"]]}
    # Meaningful only when the unmutated model passes (a failing model fails mutated too).
    mutation_ok = all(m["validation_failed"] for m in mutations.values() if m["applies"]) if verdict["passed"] \
        else None
    data = {"status": "measured" if not args.tiny else "tiny smoke run (numbers meaningless)",
            "command": " ".join(["python benchmarks/sim_validate.py", *(sys.argv[1:] if argv is None else argv)]),
            "bounds": {"step_median": STEP_MEDIAN_BOUND, "step_p90_abs": STEP_P90_BOUND, "total": TOTAL_BOUND,
                       "term_median": TERM_BOUND, "mutation": MUTATION},
            "passed": verdict["passed"], "mutation_check_passed": mutation_ok,
            "relative_error": max((r["total_error"] for r in verdict["runs"]), key=abs),
            "relative_error_note": "the run whose total time is furthest off",
            "runs": verdict["runs"], "terms": verdict["terms"], "mutations": mutations,
            "decomposed_steps": len(decomposed), "model": str(base.model_path), "dtype": str(base.dtype),
            "setup": dataclasses.asdict(setup), "wall_s": time.perf_counter() - t0}
    (out / "sim_validation.json").write_text(json.dumps(paper._finite(data), indent=1))
    print(report(data))
    print(f"\nwrote {out / 'sim_validation.json'} in {time.perf_counter() - t0:.0f}s")
    return 0


def save_records(path: Path, runs: list[dict], decomposed, calibration_steps=(), compiled_loop: bool = True) -> None:
    """The raw steps, so a cost model can be checked (or fitted) later without timing anything
    (benchmarks/sim_fit.py): the calibration and decomposed runs (what the fit may use) and
    the validation runs, each with what the simulator needs to serve its trace again."""
    def rows(records):
        return [dataclasses.asdict(r) for r in records]
    data = {"compiled_loop": compiled_loop, "decomposed": rows(decomposed), "calibration": rows(calibration_steps),
            "runs": [{**{k: run[k] for k in ("workload", "block_size", "rate", "saturated", "num_requests")},
                      "result": {"duration_s": run["result"].duration_s,
                                 "num_preemptions": run["result"].num_preemptions,
                                 "avg_batch_size": run["result"].avg_batch_size},
                      "sim_config": dataclasses.asdict(run["sim_config"]),
                      "records": rows(run["records"])} for run in runs]}
    path.write_text(json.dumps(paper._finite(data)))


def report(data: dict) -> str:
    lines = ["\n| workload | block | rate (req/s) | steps meas / sim | preemptions meas / sim | step ms meas / pred | "
             "step error median / p90 abs | total s meas / sim (error) | ok |", "|---|---|---|---|---|---|---|---|---|"]
    for r in data["runs"]:
        rate = "all at once" if r["saturated"] else f"{r['rate']:.2f}"
        lines.append(f"| {r['workload']} | {r['block_size']} | {rate} | {r['measured_steps']} / {r['predicted_steps']} | "
                     f"{r['measured_preemptions']} / {r['predicted_preemptions']} | "
                     f"{r['measured_step_mean_s'] * 1e3:.1f} / {r['predicted_step_mean_s'] * 1e3:.1f} | "
                     f"{r['step_error_median']:+.1%} / {r['step_error_p90_abs']:.1%} | "
                     f"{r['measured_total_s']:.1f} / {r['predicted_total_s']:.1f} ({r['total_error']:+.1%}) | "
                     f"{'yes' if r['ok'] else 'NO'} |")
    lines.append("\n| term | median error | steps | ok | 1.5x fails the validation |\n|---|---|---|---|---|")
    for k, t in data["terms"].items():
        m = data["mutations"].get(k, {})
        lines.append(f"| {k} | {t['median_error']:+.1%} | {t['steps']} | {'yes' if t['ok'] else 'NO'} | "
                     f"{'yes' if m.get('validation_failed') else 'NO'} |")
    mutation = {True: "passed", False: "FAILED", None: "not meaningful (the unmutated model fails)"}
    lines.append(f"\nvalidation {'PASSED' if data['passed'] else 'FAILED'}; mutation check "
                 f"{mutation[data['mutation_check_passed']]}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
