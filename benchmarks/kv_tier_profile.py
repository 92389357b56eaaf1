"""Where a disk-tier hit's time to first token goes (issue 53), step by step.

    .venv/bin/python benchmarks/kv_tier_profile.py --model /work/peers/files/smollm2-1.7b-shape-Q4_0-llama.gguf
    .venv/bin/python benchmarks/kv_tier_profile.py --quick          # the default model: checks the script

--requests prompts share a --context-token prefix (a shared system prompt, then each its own
history of --history tokens). One engine prefills them and shuts down (its cached blocks go to
the tier's directory); a restarted engine on the directory then gets each prompt plus --suffix new
tokens at once (the tier hits). For comparison, the same engine then gets the prompts again with
other new tokens (pool hits: the suffix prefill alone), and prompts of the suffix's length with
no context (the suffix's matmuls without the long attention). Printed per run: TTFT, and per
engine step its wall time split into scheduling, the forward (execute) and the tier's wait, the
prefill chunk of each request and the decode rows; the reader threads' time per block read. With
--perf, `perf record` (cpu-clock, this process) samples each run and the top symbols are printed
(attention kernels vs quantized matmuls). JSON: benchmarks/results/kv_tier_profile.json.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"

from benchmarks.vs_vllm import cpu_flags, cpu_model  # noqa: E402
from pagedserve import LLM, SamplingParams  # noqa: E402


class StepLog:
    """Wraps one engine's scheduler.schedule, executor.execute / tier_report and the tier
    store's reads; `steps` holds one dict per engine step."""

    def __init__(self, llm: LLM) -> None:
        self.steps: list[dict] = []
        self.reads: list[float] = []
        self._lock = threading.Lock()
        engine = llm.engine
        sched, ex = engine.scheduler, engine.executor
        schedule, execute, report = sched.schedule, ex.execute, ex.tier_report

        def timed_schedule():
            t0 = time.perf_counter()
            out = schedule()
            t1 = time.perf_counter()
            tier = out.batch.tier if out.batch is not None else None
            self.steps.append(dict(
                t=t0, schedule_s=t1 - t0, execute_s=0.0, save_s=0.0, tier_wait_s=0.0,
                prefill=[(s.request.request_id, s.num_new_tokens, s.start) for s in out.scheduled
                         if s.num_query_tokens > 1],
                decodes=sum(1 for s in out.scheduled if s.num_query_tokens == 1),
                loads=len(tier.loads) if tier else 0, wait=bool(tier and tier.wait)))
            return out

        sched.schedule = timed_schedule
        ex.execute = self._timed(execute, "execute_s")
        ex.tier_report = self._timed(report, "tier_wait_s")
        store = getattr(ex.runner, "tier", None)
        if store is not None:             # the engine thread's copy of evicted blocks (within execute)
            store.save = self._timed(store.save, "save_s")
        if store is not None and hasattr(store, "_read"):
            read = store._read

            def timed_read(key, block_id):
                t0 = time.perf_counter()
                try:
                    return read(key, block_id)
                finally:
                    with self._lock:
                        self.reads.append(time.perf_counter() - t0)
            store._read = timed_read

    def _timed(self, fn, key: str):
        """fn, its time added to the current step's `key`."""
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.steps:
                    self.steps[-1][key] += time.perf_counter() - t0
        return timed


class Perf:
    """perf record (cpu-clock, this process, no call graphs) around a block; `top` the symbols."""

    def __init__(self, path: str | None) -> None:
        self.path, self.proc = path, None

    def __enter__(self):
        if self.path and shutil.which("perf"):
            self.proc = subprocess.Popen(["perf", "record", "-e", "cpu-clock", "-F", "499", "-p", str(os.getpid()),
                                          "-o", self.path, "--quiet"], stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL)
            time.sleep(0.5)
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGINT)
            self.proc.wait(timeout=60)

    def top(self, n: int = 14) -> list[tuple[float, str]]:
        if self.proc is None:
            return []
        out = subprocess.run(["perf", "report", "-i", self.path, "--stdio", "--no-children", "--sort", "sym",
                              "--percent-limit", "0.8"], capture_output=True, text=True).stdout
        rows = []
        for line in out.splitlines():
            parts = line.split()
            if len(parts) >= 3 and parts[0].endswith("%") and not line.startswith("#"):
                rows.append((float(parts[0][:-1]), " ".join(parts[2:])[:110]))
        return rows[:n]


def run(llm: LLM, prompts: list[list[int]], label: str, perf_dir: str | None) -> dict:
    log = StepLog(llm)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    perf = Perf(os.path.join(perf_dir, label.replace(" ", "_") + ".data") if perf_dir else None)
    with perf:
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        wall = time.perf_counter() - start
    ttfts = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
    steps = [dict(s, t=s["t"] - log.steps[0]["t"]) for s in log.steps] if log.steps else []
    top = perf.top()
    print(f"\n{label}: {len(prompts)} prompts of {[len(p) for p in prompts]} tokens, wall {wall:.2f} s, "
          f"TTFT mean {1000 * statistics.fmean(ttfts):.0f} ms {[round(1000 * t) for t in ttfts]}")
    for i, s in enumerate(steps):
        chunks = " ".join(f"{rid}:{n}@{start}" for rid, n, start in s["prefill"])
        print(f"  step {i}: at {1000 * s['t']:7.0f} ms  schedule {1000 * s['schedule_s']:5.1f}  execute "
              f"{1000 * s['execute_s']:7.0f}  tier wait {1000 * s['tier_wait_s']:6.0f} ms  loads {s['loads']:3d}"
              f"{' (wait)' if s['wait'] else ''}  decodes {s['decodes']}  prefill [{chunks}]")
    if log.reads:
        print(f"  tier reads: {len(log.reads)} blocks, {1000 * statistics.fmean(log.reads):.1f} ms mean per block "
              f"(reader threads), {1000 * sum(log.reads):.0f} ms in all")
    for pct, sym in top:
        print(f"  perf {pct:5.1f}%  {sym}")
    return dict(label=label, prompt_tokens=[len(p) for p in prompts], wall_s=wall, ttft_s=ttfts, steps=steps,
                read_s=log.reads, perf_top=top)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--context", type=int, default=1024, help="shared prefix tokens (system prompt and tools)")
    ap.add_argument("--history", type=int, default=136, help="each prompt's own tokens after the shared prefix")
    ap.add_argument("--suffix", type=int, default=32, help="new tokens of the tier-hit turn")
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--perf", action="store_true", help="sample each run with perf record (this process)")
    ap.add_argument("--quick", action="store_true", help="context 256: checks the script")
    ap.add_argument("--out", default=str(RESULTS / "kv_tier_profile.json"))
    args = ap.parse_args()
    if args.quick:
        args.context, args.history, args.out = 256, 40, str(RESULTS / "kv_tier_profile_quick.json")
    rng = random.Random(53)
    tier_dir = tempfile.mkdtemp(prefix="kv_tier_profile_")
    perf_dir = tempfile.mkdtemp(prefix="kv_tier_perf_") if args.perf else None
    length = args.context + args.history + 2 * args.suffix + 16
    engine = dict(model=args.model, block_size=16, max_model_len=length, kv_offload_path=tier_dir, kv_offload_gb=64)
    llm = LLM(**engine)
    vocab = llm.engine.vocab_size
    words = lambda n: [rng.randrange(100, vocab) for _ in range(n)]  # noqa: E731
    system = words(args.context)
    prompts = [system + words(args.history) for _ in range(args.requests)]
    runs = [run(llm, prompts, "first engine: the prompts, cold", None)]
    llm.shutdown()                     # saves the cached blocks to the directory
    del llm
    llm = LLM(**engine)
    runs.append(run(llm, [p + words(args.suffix) for p in prompts], "restarted: tier hits", perf_dir))
    runs.append(run(llm, [p + words(args.suffix) for p in prompts], "same engine: pool hits", perf_dir))
    runs.append(run(llm, [words(args.suffix + args.history % 16) for _ in prompts], "no context: suffix alone",
                    perf_dir))
    stats = llm.kv_cache_stats()
    llm.shutdown()
    shutil.rmtree(tier_dir, ignore_errors=True)
    if perf_dir:
        shutil.rmtree(perf_dir, ignore_errors=True)
    result = dict(args=vars(args), cpu_model=cpu_model(), cpu_flags=cpu_flags(), threads=os.cpu_count(), runs=runs,
                  tier_stats={k: v for k, v in stats.items() if k.startswith("kv_offload")})
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"\nCPU: {result['cpu_model']} ({' '.join(result['cpu_flags'])}); wrote {args.out}")


if __name__ == "__main__":
    main()
