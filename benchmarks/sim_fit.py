"""The cost model against recorded engine steps, offline: nothing is timed, so it runs on a
busy machine and in tests.

    python benchmarks/sim_fit.py --steps STEPS.json --device local_device.json [--refit]
        [--validation sim_validation.json] [--out fitted_device.json]

STEPS.json is what `benchmarks/sim_validate.py --record-steps` wrote on a quiet machine:
every step of the calibration and decomposed runs (what a fit may use) and of the validation
runs (what judges it). The verdict is benchmarks/sim_validate.py's own (`evaluate`): each
validation step priced by the cost model (per-step error), each validation trace served
again by the simulator with the real scheduler (step counts, total time), each term checked.
Also printed: per run, the median error of each part of a step the engine timed (forward,
LM head, sampler, outside the model), which says which term is off.

--refit: first rescale the device's terms to the recorded calibration and decomposed steps
(sim/local.py fit_in_steps), as `sim_validate.py --calibrate` now does, for the layer loop the
recorded engine ran (--loop; the recording notes it since the compiled loop's loop factors).
--validation: the measured totals for recordings that predate their "result" field.
"""
from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import logging
import math
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import sim_validate as sv  # noqa: E402
from benchmarks.workloads import make_trace  # noqa: E402
from pagedserve.sim import CostModel, ModelShape, SimConfig, SimRequest  # noqa: E402
from pagedserve.sim.cost import StepWork  # noqa: E402
from pagedserve.sim.local import StepRecord, load_local_device, save_local_device  # noqa: E402


def load_steps(path: Path | str) -> dict:
    """A --record-steps file (gzipped where it ends in .gz)."""
    path = Path(path)
    if path.suffix == ".gz":
        with gzip.open(path, "rt") as f:
            return json.load(f)
    return json.loads(path.read_text())


def records_of(rows: list[dict]) -> list[StepRecord]:
    return [StepRecord(StepWork(**r["work"]), r["wall_s"], r.get("forward_s", 0.0), r.get("lm_head_s", 0.0),
                       r.get("sampler_s", 0.0), dict(r.get("ops_s") or {})) for r in rows]


def _setup_for(runs: list[dict]) -> sv.ValidationSetup:
    """The setup whose workloads the recorded runs match (by request counts)."""
    counts = {(r["workload"], r["num_requests"]) for r in runs}
    for setup in (sv.full_setup(), sv.quick_setup(), sv.tiny_setup()):
        if counts <= {(w.name, w.num_requests) for w in setup.workloads}:
            return setup
    raise ValueError(f"no validation setup has the recorded runs {sorted(counts)}")


def load_runs(data: dict, vocab_size: int, validation: dict | None = None) -> list[dict]:
    """The recorded validation runs as sim_validate.evaluate takes them: each trace made again
    from its seed (make_trace is deterministic), the simulator's config, the measured totals."""
    setup = _setup_for(data["runs"])
    workloads = {w.name: w for w in setup.workloads}
    measured = {(r["workload"], r["block_size"], r["saturated"]): r for r in (validation or {}).get("runs", [])}
    runs = []
    for run in data["runs"]:
        w, bs = workloads[run["workload"]], run["block_size"]
        rate = float(run["rate"])
        trace = make_trace(w.name, w.num_requests, setup.seed, vocab_size, setup.max_model_len, rate, scale=w.scale)
        if "result" in run:
            result = SimpleNamespace(**run["result"])
        else:
            m = measured[(run["workload"], bs, run["saturated"])]
            result = SimpleNamespace(duration_s=m["measured_total_s"], num_preemptions=m["measured_preemptions"],
                                     avg_batch_size=m["measured_batch"])
        config = SimConfig(**run["sim_config"]) if "sim_config" in run else SimConfig(
            num_blocks=w.kv_slots // bs, block_size=bs, max_model_len=setup.max_model_len)
        runs.append({**{k: run[k] for k in ("workload", "block_size", "saturated", "num_requests")}, "rate": rate,
                     "result": result, "records": records_of(run["records"]),
                     "sim_trace": [SimRequest(r.prompt_token_ids, r.output_len, r.arrival_time) for r in trace],
                     "sim_config": config})
    return runs


def stand_in_calibration(data: dict, which: str) -> tuple[list[StepRecord], dict]:
    """which = "WORKLOAD:BLOCK_SIZE": that saturated validation run's steps, to stand in for the
    calibration run a recording lacks, and the recording without it (it must not judge a fit
    made on it)."""
    name, bs = which.split(":")
    found = [r for r in data["runs"] if r["workload"] == name and r["block_size"] == int(bs) and r["saturated"]]
    if not found:
        raise ValueError(f"no saturated run {which} in the recording")
    return records_of(found[0]["records"]), {**data, "runs": [r for r in data["runs"] if r is not found[0]]}


def compiled_loop(data: dict, loop: str = "auto") -> bool:
    """Whether the recorded engine ran the compiled layer loop: --loop, else the recording's note
    (sim_validate.save_records), else yes (the CPU backend's loop for float and quantized models;
    the quiet recordings before the note ran it)."""
    return {"compiled": True, "python": False}.get(loop, bool(data.get("compiled_loop", True)))


def parts(cost_for, runs: list[dict]) -> list[dict]:
    """Per run, the median of predicted / measured - 1 for each part of a step the engine timed."""
    out = []
    for run in runs:
        cost = cost_for(run["block_size"])
        errs: dict[str, list[float]] = {"forward": [], "lm_head": [], "sampler": [], "outside": []}
        for r in run["records"]:
            t = cost.step_time(r.work)
            pairs = {"forward": (t.linear + t.decode_attention + t.prefill_attention + t.elementwise, r.forward_s),
                     "lm_head": (t.lm_head, r.lm_head_s), "sampler": (t.sampling, r.sampler_s),
                     "outside": (t.overhead, r.outside_kernels_s)}
            for k, (p, m) in pairs.items():
                if m > 0:
                    errs[k].append(p / m - 1)
        out.append({"workload": run["workload"], "block_size": run["block_size"], "saturated": run["saturated"],
                    **{k: statistics.median(v) if v else math.nan for k, v in errs.items()}})
    return out


def mutations(cost_for, runs: list[dict], decomposed) -> dict[str, bool]:
    """Term -> whether scaling it by sim_validate.MUTATION fails the validation."""
    return {t: not sv.evaluate(lambda bs, t=t: cost_for(bs, term_scale={t: sv.MUTATION}), runs, decomposed)["passed"]
            for t in ("linear", "lm_head", "prefill_attention", "decode_attention", "elementwise", "sampling",
                      "overhead")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", required=True, help="a sim_validate.py --record-steps file")
    p.add_argument("--device", required=True, help="the local_device.json to evaluate (or to refit)")
    p.add_argument("--validation", default=None, help="sim_validation.json (measured totals, older recordings)")
    p.add_argument("--refit", action="store_true", help="rescale the terms to the calibration and decomposed steps")
    p.add_argument("--calibration-from", default=None, metavar="WORKLOAD:BS",
                   help="for recordings without a calibration run: take this saturated validation run's steps as "
                        "the calibration run's (e.g. alpaca:16, the calibration run's own workload and block size); "
                        "it is then left out of the verdict")
    p.add_argument("--loop", choices=("auto", "compiled", "python"), default="auto",
                   help="--refit: the layer loop the recorded engine ran (as sim_validate.py --calibrate fits for "
                        "it); auto: the recording's own note, else compiled (the CPU backend's loop for float and "
                        "quantized models alike)")
    p.add_argument("--out", default=None, help="write the (refitted) device here")
    p.add_argument("--mutations", action="store_true", help="also check that each term scaled 1.5x fails")
    p.add_argument("--quick", action="store_true",
                   help="the saturated runs only (seconds; the full replay, a minute or so with --mutations)")
    args = p.parse_args(argv)
    logging.getLogger("pagedserve.scheduler").setLevel(logging.ERROR)   # the replayed runs' preemption notes
    data = load_steps(args.steps)
    device = load_local_device(args.device)
    meta = device.calibration.meta
    shape = ModelShape.preset("smollm2-135m", meta.get("dtype") or "bfloat16")
    decomposed = records_of(data["decomposed"])
    calibration = records_of(data.get("calibration", []))
    if args.calibration_from:
        calibration, data = stand_in_calibration(data, args.calibration_from)
    if args.refit:
        device = sv.fit_device(device, decomposed, calibration, shape, compiled_loop=compiled_loop(data, args.loop))
    if args.out:
        save_local_device(device, args.out)
    if args.quick:
        data = {**data, "runs": [r for r in data["runs"] if r["saturated"]]}
    validation = json.loads(Path(args.validation).read_text()) if args.validation else None
    runs = load_runs(data, shape.vocab_size, validation)
    cost_for = lambda bs, **kw: CostModel(shape, device, block_size=bs, **kw)  # noqa: E731
    verdict = sv.evaluate(cost_for, runs, decomposed)
    muts = mutations(cost_for, runs, decomposed) if args.mutations else {}
    report = {"passed": verdict["passed"], "runs": verdict["runs"], "terms": verdict["terms"],
              "mutations": {k: {"validation_failed": v} for k, v in muts.items()},
              "mutation_check_passed": all(muts.values()) if muts and verdict["passed"] else None}
    print(sv.report(report))
    print("\n| run | forward | LM head | sampler | outside the model |\n|---|---|---|---|---|")
    for r in parts(cost_for, runs):
        print(f"| {r['workload']} bs {r['block_size']} {'saturated' if r['saturated'] else 'below'} | "
              f"{r['forward']:+.1%} | {r['lm_head']:+.1%} | {r['sampler']:+.1%} | {r['outside']:+.1%} |")
    if args.refit:
        fit = dataclasses.asdict(device.calibration)["meta"].get("in_step_fit", {})
        print(f"\nin-step fit: decode attention x{fit.get('decode_attention_factor') or 1:.2f}, prefill attention "
              f"x{fit.get('prefill_attention_factor') or 1:.2f}, linear factors "
              + ", ".join(f"{int(x)}: {f:.2f}" for x, f in fit.get("linear_factors", [])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
