"""Single-stream decode on shared cores: ms/token with 0, 1 and 2 competing busy processes,
with OpenMP's old settings (libgomp's spin-wait default) and pagedserve's (kernels/threads.py).

    .venv/bin/python benchmarks/threads.py            # the full run (about 3-4 minutes on 2 cores)
    .venv/bin/python benchmarks/threads.py --quick    # a smoke run

Each cell is a fresh process (libgomp reads its settings once, when it loads) that loads the
model, decodes a warm-up, then decodes one request greedily and times its steps until
--tokens tokens or --budget seconds, whichever comes first. The competitors are busy loops
(`while True: pass`) started before it and stopped after it, as a neighbour's job or a
container sharing the cores would be. Settings:
- old: the environment as it was before (PAGEDSERVE_OPENMP_DEFAULTS=0: libgomp's defaults);
- new: pagedserve's defaults (GOMP_SPINCOUNT, OMP_NUM_THREADS from the affinity and quota);
- passive: OMP_WAIT_POLICY=PASSIVE (threads sleep at once), for comparison.
Writes benchmarks/results/threads.json and prints a markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OPENMP_VARS = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "PAGEDSERVE_OPENMP_DEFAULTS")
SETTINGS = {
    "old": {"PAGEDSERVE_OPENMP_DEFAULTS": "0"},
    "new": {},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
}
PROMPT = "The history of the printing press begins"


def child(args) -> None:
    """One cell: load, warm up, time decode steps; print one JSON line."""
    sys.path.insert(0, str(ROOT))
    from pagedserve import LLM, SamplingParams
    llm = LLM(args.model, dtype=args.dtype, kv_cache_memory=256 * 1024**2, enable_prefix_caching=False)
    llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    engine = llm.llm_engine
    engine.add_request("timed", PROMPT, SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True))
    engine.step()                                # the prefill and the first token
    steps, start = 0, time.perf_counter()
    while engine.has_unfinished_requests() and time.perf_counter() - start < args.budget:
        engine.step()
        steps += 1
    elapsed = time.perf_counter() - start
    for rid in list(engine.requests):
        engine.abort_request(rid)
    import torch
    print(json.dumps({"ms_per_token": 1000 * elapsed / max(steps, 1), "tokens": steps,
                      "threads": torch.get_num_threads(), "dtype": str(engine.dtype).removeprefix("torch."),
                      "GOMP_SPINCOUNT": os.environ.get("GOMP_SPINCOUNT"),
                      "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY")}))


def run_cell(args, setting: str, dtype: str, competitors: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in OPENMP_VARS}
    env.update(SETTINGS[setting])
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(competitors)]
    try:
        cmd = [sys.executable, __file__, "--child", "--dtype", dtype, "--tokens", str(args.tokens),
               "--budget", str(args.budget), *(["--model", args.model] if args.model else [])]
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    if res.returncode != 0:
        raise RuntimeError(f"cell {setting}/{dtype}/{competitors} failed:\n{res.stderr[-3000:]}")
    row = json.loads(res.stdout.strip().splitlines()[-1])
    row.update(setting=setting, requested_dtype=dtype, competitors=competitors)
    print(f"  {setting:8s} {dtype:8s} {competitors} busy: {row['ms_per_token']:.1f} ms/token "
          f"({row['tokens']} tokens, {row['threads']} threads)", file=sys.stderr, flush=True)
    return row


def table(rows: list[dict], competitors: list[int]) -> str:
    lines = ["| dtype | setting | " + " | ".join(f"{c} busy (ms/token)" for c in competitors)
             + " | slowdown at the most busy |",
             "|---|---|" + "---:|" * (len(competitors) + 1)]
    keys = sorted({(r["requested_dtype"], r["setting"]) for r in rows}, key=lambda k: (k[0], list(SETTINGS).index(k[1])))
    for dtype, setting in keys:
        cells = {r["competitors"]: r["ms_per_token"] for r in rows if (r["requested_dtype"], r["setting"]) == (dtype, setting)}
        slow = cells[competitors[-1]] / cells[competitors[0]]
        lines.append(f"| {dtype} | {setting} | " + " | ".join(f"{cells[c]:.1f}" for c in competitors)
                     + f" | {slow:.1f}x |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: one dtype, old and new, 0 and 1 busy")
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--dtypes", nargs="+", default=["auto", "float32"])
    ap.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    ap.add_argument("--competitors", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--tokens", type=int, default=64, help="most tokens timed per cell")
    ap.add_argument("--budget", type=float, default=5.0, help="most seconds of decoding timed per cell")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "threads.json"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default="auto", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    if args.quick:
        args.dtypes, args.settings, args.competitors = args.dtypes[:1], ["old", "new"], args.competitors[:2]
        args.tokens, args.budget = min(args.tokens, 8), min(args.budget, 1.0)
    start = time.perf_counter()
    rows = [run_cell(args, s, d, c) for d in args.dtypes for s in args.settings for c in args.competitors]
    result = {"cpus": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)), "model": args.model or "default",
              "tokens": args.tokens, "budget_s": args.budget, "wall_s": time.perf_counter() - start, "rows": rows}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(table(rows, args.competitors))
    print(f"\n({len(rows)} cells in {result['wall_s']:.0f} s; {out})")


if __name__ == "__main__":
    main()
