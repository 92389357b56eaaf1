"""Admission control: preemptions and recomputed tokens vs the admission watermark.

    python benchmarks/admission.py [--quick] [--out DIR]

The paper-scale ShareGPT-like trace (1000 requests, OPT-13B on an A100-40GB: 2048-token
context, 16-token blocks, the KV cache that leaves) served by the real scheduler and paged KV
manager on the step-time simulator (pagedserve/sim), all requests at once (where memory binds
hardest) and at a rate near the paged engine's capacity. Preemption and recompute counts
depend only on the scheduler, so they are deterministic; the throughput and latency columns
are the simulator's (A100 preset), not measurements. Writes DIR/admission.json.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import logging  # noqa: E402

from benchmarks.workloads import make_trace  # noqa: E402
from pagedserve.sim import DEVICES, CostModel, ModelShape, SimConfig, SimRequest, simulate  # noqa: E402

WATERMARKS = [0.0, 0.01, 0.02, 0.05, 0.1, 0.2]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="200 requests, three watermarks")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    p.add_argument("--device", default="a100-40gb", choices=list(DEVICES))
    p.add_argument("--model-preset", default="opt-13b")
    args = p.parse_args(argv)
    logging.getLogger("pagedserve.scheduler").setLevel(logging.ERROR)   # preemption warnings: counted here
    n, marks = (200, [0.0, 0.01, 0.1]) if args.quick else (1000, WATERMARKS)
    cost = CostModel(ModelShape.preset(args.model_preset), DEVICES[args.device])
    num_blocks = cost.kv_cache_tokens() // 16
    rows = []
    for rate in (math.inf, 3.0):
        trace = [SimRequest(r.prompt_token_ids, r.output_len, r.arrival_time)
                 for r in make_trace("sharegpt", n, 0, 50272, 2048, rate)]
        for wm in marks:
            t0 = time.perf_counter()
            r = simulate(trace, SimConfig(num_blocks=num_blocks, admission_watermark=wm), cost)
            rows.append({"rate": rate, "admission_watermark": wm, **r.summary(),
                         "preemptions_per_request": r.num_preemptions / n,
                         "recomputed_tokens_per_request": r.num_recomputed_tokens / n})
            print(f"rate {rate:>4} watermark {wm:5.2f}: {r.num_preemptions:5d} preemptions "
                  f"({r.num_preemptions / n:.2f}/request), {r.num_recomputed_tokens:7d} tokens recomputed, "
                  f"steady {r.steady_throughput_rps:.3f} req/s, {r.mean_normalized_latency:.4f} s/token "
                  f"(sim), batch {r.avg_batch_size:.1f}  ({time.perf_counter() - t0:.0f}s)", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = {"command": " ".join(["python benchmarks/admission.py", *(sys.argv[1:] if argv is None else argv)]),
            "device": args.device, "model": args.model_preset, "num_blocks": num_blocks, "num_requests": n,
            "runs": [{k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
                     for row in rows]}
    (out / "admission.json").write_text(json.dumps(data, indent=1))
    print("\n| rate (req/s) | watermark | preemptions / request | recomputed tokens | steady req/s (sim) "
          "| s/token (sim) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['rate']} | {r['admission_watermark']:.0%} | {r['preemptions_per_request']:.2f} | "
              f"{r['num_recomputed_tokens']} | {r['steady_throughput_rps']:.3f} | {r['mean_normalized_latency']:.4f} |")
    print(f"\nwrote {out / 'admission.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
