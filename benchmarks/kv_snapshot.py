"""What the dashboard's KV snapshots cost, on a cache of 10k blocks (issue 21).

    .venv/bin/python benchmarks/kv_snapshot.py --quick      # the lead's run (well under a minute)
    .venv/bin/python benchmarks/kv_snapshot.py --blocks 10000 40000 --reps 200

The engine's own Scheduler and KV cache manager are filled without a model (a "model" that
samples token 0, as in benchmarks/memory_sim.py): parallel-sampling requests (n=4) over
seeded random prompts, some sharing a system prompt, run until the cache is ~90% used, and
a few requests finish so their blocks stay cached. Then, on that state:

- capture: what the engine thread pays, between two steps (`engine/kv_view.py capture`:
  the KV manager's `snapshot()` list copies and the requests' records);
- render / update: building the page's JSON from a capture (all blocks, or the blocks that
  changed after one more step) and encoding it; done on a worker thread, but it holds the GIL.

At most one capture is taken per refresh interval (and per step), so the engine's share of
time lost is at most capture / interval; the issue's budget is 1% at the default interval
(0.5 s, `--kv-snapshot-interval`). Prints a markdown table and writes
benchmarks/results/kv_snapshot.json.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pagedserve.batch import RunnerOutput  # noqa: E402
from pagedserve.config import EngineConfig  # noqa: E402
from pagedserve.engine.kv_view import KVView, capture  # noqa: E402
from pagedserve.engine.llm_engine import LLMEngine  # noqa: E402
from pagedserve.request import Request  # noqa: E402
from pagedserve.sampling_params import SamplingParams  # noqa: E402
from pagedserve.scheduler import Scheduler  # noqa: E402
from pagedserve.server.dashboard import DEFAULT_INTERVAL  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "kv_snapshot.json"
BLOCK_SIZE = 16
MAX_MODEL_LEN = 8192
VOCAB = 49152                # the default model's vocabulary


class SimEngine:
    """What `capture` reads of an LLMEngine, over a Scheduler driven without a model."""
    kv_cache_stats = LLMEngine.kv_cache_stats
    kv_storage: dict = {}          # no model: no KV dtype to report

    def __init__(self, num_blocks: int, num_host_blocks: int) -> None:
        config = EngineConfig(block_size=BLOCK_SIZE, max_num_seqs=256, max_num_batched_tokens=8192,
                              preemption_mode="swap" if num_host_blocks else "recompute",
                              swap_space=1 if num_host_blocks else 0)
        self.config = config
        self.scheduler = Scheduler(config, num_blocks, MAX_MODEL_LEN, num_host_blocks)
        self.max_model_len = MAX_MODEL_LEN
        self.num_steps = 0

    def add(self, rid: str, prompt: list[int], n: int, max_tokens: int) -> None:
        sched = self.scheduler
        req = Request.create(rid, None, prompt,
                             SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, ignore_eos=True), max_tokens,
                             sched.new_seq_id())
        sched.add_request(req)

    def step(self) -> None:
        sched = self.scheduler
        out = sched.schedule()
        ids = [s.seq.seq_id for s in out.sampled]
        sched.update_from_output(out, RunnerOutput.of_tokens(ids, [0] * len(ids)))
        self.num_steps += 1


def fill(num_blocks: int, seed: int) -> SimEngine:
    """A cache ~90% used by running requests (n=4, shared prompts) with some cached blocks left
    by requests that finished."""
    rng = random.Random(seed)
    engine = SimEngine(num_blocks, num_host_blocks=num_blocks // 10)
    system = [rng.randrange(VOCAB) for _ in range(256)]
    i = 0
    while engine.scheduler.kv.num_used_blocks < 0.9 * num_blocks and i < 4 * num_blocks:
        if len(engine.scheduler.waiting) < 8:
            prompt = (system if i % 2 else []) + [rng.randrange(VOCAB) for _ in range(rng.randrange(100, 700))]
            # Short ones finish early and leave their blocks cached; long ones keep growing.
            max_tokens = rng.choice([8, min(2000, num_blocks * BLOCK_SIZE // 8)])
            engine.add(f"r{i}", prompt, 4 if i % 3 else 1, max_tokens)
            i += 1
        engine.step()
    return engine


def timed(fn, reps: int) -> tuple[list[float], object]:
    times, out = [], None
    for _ in range(reps):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return times, out


def measure(num_blocks: int, reps: int, seed: int, decode) -> dict:
    engine = fill(num_blocks, seed)
    capture_s, cap = timed(lambda: capture(engine), reps)
    view = KVView(decode)
    render_s, full_json = timed(lambda: json.dumps(KVView(decode).full(cap), separators=(",", ":")),
                                max(3, reps // 10))
    view.full(cap)
    update_s, update_bytes = [], []
    for _ in range(max(3, reps // 10)):
        engine.step()
        nxt = capture(engine)
        t = time.perf_counter()
        update = view.update(nxt)
        text = json.dumps(update, separators=(",", ":"))
        update_s.append(time.perf_counter() - t)
        update_bytes.append(len(text))
    stats = engine.kv_cache_stats()
    med = statistics.median
    return {
        "num_blocks": num_blocks, "num_host_blocks": stats["num_host_blocks"],
        "used_blocks": stats["num_used_blocks"], "cached_blocks": stats["num_cached_blocks"],
        "requests": len(cap.requests), "sequences": sum(len(r.seqs) for r in cap.requests),
        "capture_ms_median": 1e3 * med(capture_s), "capture_ms_p90": 1e3 * sorted(capture_s)[int(0.9 * len(capture_s))],
        "render_full_ms_median": 1e3 * med(render_s), "full_json_bytes": len(full_json),
        "update_ms_median": 1e3 * med(update_s), "update_json_bytes_median": med(update_bytes),
        "engine_share_at_default_interval": med(capture_s) / DEFAULT_INTERVAL,
        "gil_share_at_default_interval": (med(capture_s) + med(update_s)) / DEFAULT_INTERVAL,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="10k blocks, 50 captures")
    ap.add_argument("--blocks", type=int, nargs="+", default=[10_000])
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-text", action="store_true", help="skip decoding cached blocks' text (no tokenizer)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    if args.quick:
        args.blocks, args.reps = [10_000], 50
    decode = None
    if not args.no_text:
        from pagedserve.models.loader import default_model_path, load_tokenizer
        decode = load_tokenizer(default_model_path()).decode
    rows = [measure(n, args.reps, args.seed, decode) for n in args.blocks]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"interval_s": DEFAULT_INTERVAL, "rows": rows}, indent=2) + "\n")
    print(f"KV snapshot cost (default refresh interval {DEFAULT_INTERVAL} s; budget: 1% of engine time)\n")
    print("| blocks | used / cached | requests (seqs) | capture, engine thread (median / p90) | engine time at default "
          "interval | full render + JSON | one step's update + JSON | update size |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['num_blocks']} | {r['used_blocks']} / {r['cached_blocks']} | {r['requests']} ({r['sequences']}) | "
              f"{r['capture_ms_median']:.2f} / {r['capture_ms_p90']:.2f} ms | "
              f"{100 * r['engine_share_at_default_interval']:.3f}% | {r['render_full_ms_median']:.1f} ms "
              f"({r['full_json_bytes'] / 1e6:.1f} MB) | {r['update_ms_median']:.1f} ms | "
              f"{r['update_json_bytes_median'] / 1e3:.0f} kB |")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
