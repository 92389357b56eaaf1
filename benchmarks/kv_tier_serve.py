"""Staggered long-prefix arrivals through the OpenAI-compatible server (issue 53): the disk tier's
read-ahead of queued requests' blocks, on against off, and no tier.

    .venv/bin/python benchmarks/kv_tier_serve.py --quick          # the default model: checks the script
    .venv/bin/python benchmarks/kv_tier_serve.py                  # the default model, 8 sessions, 2 rounds
    # a larger model, one part per call (each within a 5-minute timed run), the same --dir throughout:
    .venv/bin/python benchmarks/kv_tier_serve.py --model M.gguf --dir /tmp/d --part fill
    .venv/bin/python benchmarks/kv_tier_serve.py --model M.gguf --dir /tmp/d --part runs --runs read-ahead,no-read-ahead

Each of --sessions sessions has its own --prefix-token history (an agent's system prompt, tools and
transcript so far). A first server with the disk tier (--kv-offload-path) takes every prefix once
and stops (SIGTERM: the pool's cached blocks go to the directory); the directory is kept as the
base. Each run is then a fresh server (a restart: `pagedserve serve` on 127.0.0.1, a free port) on
a copy of the base (hard links), the files' pages dropped first (posix_fadvise; the reads go to the disk), with
--max-num-seqs seats: after one short warm-up request, every session sends its next turn (its
prefix plus --user new tokens; --answer tokens generated greedily, streamed) at its arrival time,
--gap seconds apart (--poisson: exponential gaps of that mean, the same seeded schedule in every
run), so later turns arrive while earlier ones run and queue for a seat. Runs:
  read-ahead      the tier, as served by default: a queued turn's tier reads start on arrival
  no-read-ahead   the tier with --no-kv-offload-read-ahead: its reads start when admission reaches it
  no-tier         no tier: every prefix is prefilled again
--rounds repeats them, the order reversed every other round. Reported per run: TTFT (sent to the
first streamed chunk: mean, median, max), wall (first arrival to last answer), output tokens/s, the
tier's hit rate (/metrics: external_prefix_cache_hits / _queries, prompt tokens past the pool's
hits), bytes read and read per second of the run; and the base directory's read bandwidth with its
pages dropped (the disk: the bound of a tier read) and from the page cache. JSON:
benchmarks/results/kv_tier_serve.json (runs merge into --out by name, so parts add up).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"

from benchmarks.kv_tier import drop_pages, read_bandwidth  # noqa: E402
from benchmarks.vs_vllm import cpu_flags, cpu_model  # noqa: E402
from pagedserve.server.launcher import ServerProcess, launch_server  # noqa: E402
from pagedserve.utils import cdiv  # noqa: E402

RUNS = ("read-ahead", "no-read-ahead", "no-tier")
BLOCK = 16
# /metrics counters read before and after a run (pagedserve: prefix; vLLM's names where they exist).
COUNTERS = ("external_prefix_cache_queries", "external_prefix_cache_hits", "kv_offload_bytes_read",
            "prefix_cache_queries", "prefix_cache_hits")


@dataclass
class Turn:
    session: int
    arrival_s: float          # after the first arrival
    sent_s: float = 0.0
    ttft_s: float = 0.0
    done_s: float = 0.0       # the last chunk, after the first arrival
    tokens: int = 0


def make_prompts(args) -> tuple[list[list[int]], list[list[int]]]:
    """Per session its prefix, and its next turn's new tokens."""
    rng = random.Random(53)
    draw = lambda n: [rng.randrange(100, args.vocab) for _ in range(n)]  # noqa: E731
    return [draw(args.prefix) for _ in range(args.sessions)], [draw(args.user) for _ in range(args.sessions)]


def arrivals(args) -> list[float]:
    rng, t, out = random.Random(7), 0.0, []
    for _ in range(args.sessions):
        out.append(t)
        t += rng.expovariate(1 / args.gap) if args.poisson else args.gap
    return out


def complete(client: httpx.Client, model: str, prompt: list[int], max_tokens: int) -> tuple[float, int]:
    """One streamed greedy completion: seconds to its first chunk, tokens generated."""
    start, first = time.perf_counter(), None
    body = dict(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, ignore_eos=True, stream=True,
                stream_options=dict(include_usage=True))
    tokens = 0
    with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read().decode(errors='replace')[:500]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if first is None:
                first = time.perf_counter() - start
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    if first is None:
        raise RuntimeError("no chunk streamed")
    return first, tokens


def counters(server: ServerProcess) -> dict[str, float]:
    """The COUNTERS' values in /metrics (summed over label sets)."""
    text = httpx.get(server.url + "/metrics", timeout=30).text
    out = dict.fromkeys(COUNTERS, 0.0)
    for line in text.splitlines():
        for name in COUNTERS:
            if line.startswith(f"pagedserve:{name}_total"):
                out[name] += float(line.rsplit(" ", 1)[1])
    return out


def server_args(args, pool: int, tier_dir: str | None, read_ahead: bool = True) -> list[str]:
    out = ["--num-gpu-blocks-override", str(pool), "--block-size", str(BLOCK), "--max-num-seqs", str(args.max_num_seqs),
           "--max-model-len", str(args.prefix + args.user + args.answer + BLOCK), "--shutdown-timeout", "1",
           "--load-format", args.load_format, *(["--quantization", args.quantization] if args.quantization else [])]
    if tier_dir is not None:
        out += ["--kv-offload-path", tier_dir, "--kv-offload-gb", "64"]
        if not read_ahead:
            out.append("--no-kv-offload-read-ahead")
    return out


def start(args, extra: list[str], log: Path) -> tuple[ServerProcess, str]:
    server = launch_server(args.model, extra, log, timeout=600)
    model = httpx.get(server.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    return server, model


def fill(args, pool: int, base: Path, prefixes: list[list[int]]) -> float:
    """A server with the tier takes every prefix once, then stops: its cached blocks go to `base`."""
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    server, model = start(args, server_args(args, pool, str(base)), base.parent / "fill.log")
    t0 = time.perf_counter()
    try:
        with httpx.Client(base_url=server.url, timeout=3600) as client:
            threads = [threading.Thread(target=complete, args=(client, model, p, 1)) for p in prefixes]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    finally:
        server.stop(timeout=600)
    took = time.perf_counter() - t0
    files = list(base.glob("*.kvb"))
    print(f"fill: {len(prefixes)} prefixes in {took:.1f} s; {len(files)} files, "
          f"{sum(f.stat().st_size for f in files) / 1e6:.0f} MB in {base}", flush=True)
    return took


def one_run(args, name: str, pool: int, base: Path, work: Path, prefixes, users) -> dict:
    """A fresh server (a restart) on a copy of the base directory: the turns at their arrivals."""
    tier_dir = None
    if name != "no-tier":
        tier_dir = work / "tier"
        shutil.rmtree(tier_dir, ignore_errors=True)
        shutil.copytree(base, tier_dir, copy_function=os.link)   # the tier writes new files and renames: links suffice
        drop_pages(str(tier_dir))
    server, model = start(args, server_args(args, pool, tier_dir and str(tier_dir), name == "read-ahead"),
                          work / f"{name}.log")
    try:
        with httpx.Client(base_url=server.url, timeout=3600) as client:
            complete(client, model, [5 + i for i in range(BLOCK + 3)], 2)      # warm-up: not a session's prefix
            before = counters(server)
            turns = [Turn(i, a) for i, a in enumerate(arrivals(args))]
            t0 = time.perf_counter()

            def go(turn: Turn) -> None:
                time.sleep(max(0.0, t0 + turn.arrival_s - time.perf_counter()))
                turn.sent_s = time.perf_counter() - t0
                turn.ttft_s, turn.tokens = complete(client, model, prefixes[turn.session] + users[turn.session],
                                                    args.answer)
                turn.done_s = time.perf_counter() - t0

            threads = [threading.Thread(target=go, args=(t,)) for t in turns]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            wall = max(t.done_s for t in turns)
            after = counters(server)
    finally:
        server.stop(timeout=600)
    c = {k: after[k] - before[k] for k in COUNTERS}
    ttfts = [t.ttft_s for t in turns]
    tiered = tier_dir is not None
    run = dict(turns=[asdict(t) for t in turns], wall_s=wall, mean_ttft_s=statistics.fmean(ttfts),
               median_ttft_s=statistics.median(ttfts), max_ttft_s=max(ttfts),
               output_tok_s=sum(t.tokens for t in turns) / wall, counters=c,
               tier_hit_rate=c["external_prefix_cache_hits"] / c["external_prefix_cache_queries"]
               if tiered and c["external_prefix_cache_queries"] else None,
               tier_bytes_read=c["kv_offload_bytes_read"] if tiered else None,
               tier_bytes_read_per_s=c["kv_offload_bytes_read"] / wall if tiered else None)
    print(f"  {name:14} mean TTFT {run['mean_ttft_s'] * 1e3:6.0f} ms, median {run['median_ttft_s'] * 1e3:6.0f}, "
          f"max {run['max_ttft_s'] * 1e3:6.0f}; wall {wall:5.1f} s; per turn (ms): "
          + " ".join(f"{t.ttft_s * 1e3:.0f}" for t in turns), flush=True)
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the default model (SmolLM2-135M-Instruct, Q4_1)")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--prefix", type=int, default=2048, help="tokens of each session's prefix (kept in the tier)")
    ap.add_argument("--user", type=int, default=32, help="new tokens of each session's next turn")
    ap.add_argument("--answer", type=int, default=64, help="tokens generated per turn")
    ap.add_argument("--gap", type=float, default=0.5, help="seconds between arrivals (the mean with --poisson)")
    ap.add_argument("--poisson", action="store_true", help="exponential gaps (seeded: the same in every run)")
    ap.add_argument("--max-num-seqs", type=int, default=2, help="the server's seats: later turns queue for one")
    ap.add_argument("--pool-share", type=float, default=0.5,
                    help="the KV pool as a share of every session's turn (at least --max-num-seqs + 1 turns)")
    ap.add_argument("--vocab", type=int, default=30000, help="token ids are drawn below this")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated, of {', '.join(RUNS)}")
    ap.add_argument("--part", choices=("all", "fill", "runs"), default="all",
                    help="fill: the base directory only; runs: the runs on an existing one (needs --dir)")
    ap.add_argument("--dir", default=None, help="work directory (default: a new one under /tmp, removed after)")
    ap.add_argument("--quick", action="store_true", help="4 sessions of 512-token prefixes, 16 answer tokens, 1 round")
    ap.add_argument("--out", default=str(RESULTS / "kv_tier_serve.json"))
    args = ap.parse_args()
    if args.quick:
        args.sessions, args.prefix, args.answer, args.rounds = 4, 512, 16, 1
        args.out = str(RESULTS / "kv_tier_serve_quick.json")
    runs = [r for r in args.runs.split(",") if r]
    if not set(runs) <= set(RUNS):
        ap.error(f"--runs: each of {', '.join(RUNS)}")
    if args.part != "all" and args.dir is None:
        ap.error("--part needs --dir")
    work = Path(args.dir or tempfile.mkdtemp(prefix="kv_tier_serve_"))
    work.mkdir(parents=True, exist_ok=True)
    base = work / "base"
    turn_blocks = cdiv(args.prefix + args.user + args.answer, BLOCK)
    pool = max(int(args.sessions * turn_blocks * args.pool_share), int((args.max_num_seqs + 1) * turn_blocks / 0.95) + 1)
    prefixes, users = make_prompts(args)
    previous = json.loads(Path(args.out).read_text()) if args.part == "runs" and Path(args.out).exists() else {}
    results: dict[str, list] = {k: list(v) for k, v in previous.get("runs", {}).items()}
    fill_s = previous.get("fill_s")
    if args.part in ("all", "fill"):
        fill_s = fill(args, pool, base, prefixes)
    disk = previous.get("disk", {})
    if args.part in ("all", "runs"):
        if not any(base.glob("*.kvb")):
            sys.exit(f"{base} holds no tier files: run --part fill first, with the same --dir")
        disk = read_bandwidth(str(base))
        for r in range(args.rounds):
            print(f"round {r + 1}", flush=True)
            for name in (runs if r % 2 == 0 else runs[::-1]):
                results.setdefault(name, []).append(one_run(args, name, pool, base, work, prefixes, users))
        shutil.rmtree(work / "tier", ignore_errors=True)
    if args.dir is None:
        shutil.rmtree(work, ignore_errors=True)

    print(f"{args.sessions} sessions, prefix {args.prefix} tokens each (in the tier after a restart), user {args.user}, "
          f"answer {args.answer}; arrivals {'Poisson, mean gap' if args.poisson else 'every'} {args.gap} s; "
          f"max_num_seqs {args.max_num_seqs}; pool {pool} blocks of {BLOCK} ({turn_blocks} a turn)")
    print(f"{'run':14} {'round':>5} {'mean TTFT':>10} {'median':>8} {'max':>8} {'wall':>7} {'out tok/s':>9} "
          f"{'tier hit':>8} {'read MB':>8} {'MB/s':>7}")
    for name, rounds in results.items():
        for i, r in enumerate(rounds):
            hit = "-" if r["tier_hit_rate"] is None else f"{100 * r['tier_hit_rate']:.1f}%"
            mb = "-" if r["tier_bytes_read"] is None else f"{r['tier_bytes_read'] / 1e6:.0f}"
            rate = "-" if r["tier_bytes_read_per_s"] is None else f"{r['tier_bytes_read_per_s'] / 1e6:.1f}"
            print(f"{name:14} {i + 1:5} {r['mean_ttft_s'] * 1e3:8.0f}ms {r['median_ttft_s'] * 1e3:6.0f}ms "
                  f"{r['max_ttft_s'] * 1e3:6.0f}ms {r['wall_s']:6.1f}s {r['output_tok_s']:9.1f} {hit:>8} {mb:>8} {rate:>7}")
    means = {name: statistics.fmean(r["mean_ttft_s"] for r in rounds) for name, rounds in results.items()}
    if "read-ahead" in means and "no-read-ahead" in means:
        print(f"mean TTFT over rounds: read-ahead {means['read-ahead'] * 1e3:.0f} ms, without "
              f"{means['no-read-ahead'] * 1e3:.0f} ms ({means['no-read-ahead'] / means['read-ahead']:.2f}x)")
    if "read-ahead" in means and "no-tier" in means:
        print(f"no tier {means['no-tier'] * 1e3:.0f} ms: {means['no-tier'] / means['read-ahead']:.2f}x the tier's")
    if disk:
        print(f"tier directory: {disk['files']} files, {disk['bytes'] / 1e6:.0f} MB; read bandwidth "
              f"{disk['cold_read_bytes_s'] / 1e6:.0f} MB/s with pages dropped, {disk['warm_read_bytes_s'] / 1e6:.0f} MB/s warm")
    result = dict(args=vars(args), cpu_model=cpu_model(), cpu_flags=cpu_flags(), threads=os.cpu_count(),
                  pool_blocks=pool, turn_blocks=turn_blocks, arrivals_s=arrivals(args), fill_s=fill_s, runs=results,
                  mean_ttft_over_rounds_s=means, disk=disk)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"CPU: {result['cpu_model']} ({' '.join(result['cpu_flags'])}); wrote {args.out}")


if __name__ == "__main__":
    main()
