"""The prefix cache's disk tier (issue 53) on a multi-turn agent workload.

    .venv/bin/python benchmarks/kv_tier.py              # the default model, 32 sessions x 4 turns (~3 min quiet)
    .venv/bin/python benchmarks/kv_tier.py --quick      # 8 sessions x 2 turns: checks the script
    .venv/bin/python benchmarks/kv_tier.py --model tinyllama-1.1b --load-format dummy --quantization q4_0
    # a larger model, one run per call (each within a 5-minute timed run), the same --dir throughout:
    .venv/bin/python benchmarks/kv_tier.py --model M.gguf --warm --dir /tmp/t --part no-tier   # then tier, restart
    # a part too long for one run: --turn-range 0:2, then 2:4 (each a fresh engine, the results added up)

Sessions share a long system prompt and tool list (--system tokens); each turn sends the session's
whole history (system, then per earlier turn its user message and the model's answer) plus a new
user message (--user tokens) and generates --answer tokens, greedily; sessions take turns round
robin, --concurrency at a time. The KV pool is a quarter of the working set (the shared prompt and
every session's history), so a session's history is evicted before its next turn comes. Runs, each
a fresh engine with the same pool:
  no tier        every turn recomputes the history the pool lost
  tier           --kv-offload-path: the history comes back from the disk tier
  restart, tier  a new engine on the tier's directory: every session's next turn
  restart, cold  a new engine without it: the same requests
With --warm the shared prompt is prefilled once, untimed, before the first two runs' turns (a
server's steady state, where the system prompt is already cached); the restart runs never warm it.
Reported: mean (and median) time to first token, output tokens/s and requests/s, the tier's hit
rate (prompt tokens past the pool's hits found in the tier), bytes read per second of the run, and
the directory's read bandwidth measured after (cold: pages dropped with posix_fadvise; warm: from
the page cache), the bound of what a tier read can cost, and the share of answers alike between runs
(tests/test_kv_tier.py checks that the tier's tokens are exact; here the runs compute different
chunks in bf16, see same_share). Results: a table and benchmarks/results/kv_tier.json.
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
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"

from benchmarks.kv_tier_profile import StepLog  # noqa: E402
from benchmarks.vs_vllm import cpu_flags, cpu_model  # noqa: E402
from pagedserve import LLM, SamplingParams  # noqa: E402
from pagedserve.utils import cdiv  # noqa: E402


@dataclass
class Session:
    history: list[int]                 # the system prompt, then each turn's user message and answer
    users: list[list[int]]             # the user message of each turn
    answers: list[list[int]] = field(default_factory=list)


def make_sessions(args, vocab: int) -> list[Session]:
    rng = random.Random(53)
    system = [rng.randrange(100, vocab) for _ in range(args.system)]
    return [Session(list(system), [[rng.randrange(100, vocab) for _ in range(args.user)]
                                   for _ in range(args.turns + 1)]) for _ in range(args.sessions)]


def run_turns(llm: LLM, sessions: list[Session], turns: range, args) -> dict:
    """Each turn of `turns` for every session, --concurrency requests at a time; the answers
    extend the histories. Returns the times to first token and the totals (with --step-log, each
    turn's steps up to its first tokens, split as kv_tier_profile.StepLog splits them)."""
    params = SamplingParams(temperature=0, max_tokens=args.answer, ignore_eos=True)
    ttfts, generated, prompt_tokens = [], 0, 0
    log = StepLog(llm) if args.step_log else None
    per_turn: dict[int, list[dict]] = {}
    start = time.perf_counter()
    for turn in turns:
        for i in range(0, len(sessions), args.concurrency):
            group = sessions[i:i + args.concurrency]
            prompts = [s.history + s.users[turn] for s in group]
            first_step = len(log.steps) if log else 0
            outs = arrive_apart(llm, prompts, params, args.arrival_gap) if args.arrival_gap else \
                llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            if log:
                per_turn.setdefault(turn, []).append(prefill_steps(log.steps[first_step:]))
            for s, p, out in zip(group, prompts, outs):
                m = out.metrics
                ttfts.append(m.first_token_time - m.arrival_time)
                answer = list(out.outputs[0].token_ids)
                s.answers.append(answer)
                s.history = p + answer
                generated += len(answer)
                prompt_tokens += len(p)
    wall = time.perf_counter() - start
    print(f"  {len(ttfts)} requests in {wall:.1f} s, mean TTFT {1000 * statistics.fmean(ttfts):.0f} ms", flush=True)
    stats = llm.kv_cache_stats()
    raw = dict(ttfts=ttfts, wall_s=wall, generated=generated, prompt_tokens=prompt_tokens,
               prefix_cache_queries=stats["prefix_cache_queries"], prefix_cache_hits=stats["prefix_cache_hits"],
               num_evicted_blocks=stats["num_evicted_blocks"], tiered="kv_offload_queries" in stats)
    raw.update({k: stats.get("kv_offload_" + k, 0) for k in TIER_COUNTERS})
    if log:
        raw["turn_steps"] = {str(t): {k: statistics.fmean(g[k] for g in groups) for k in groups[0]}
                             for t, groups in per_turn.items()}
        for t, m in raw["turn_steps"].items():
            print(f"  turn {t}: {m['steps']:.1f} steps to the first tokens, prefill {m['tokens']:.0f} tokens, "
                  f"loads {m['loads']:.1f}; schedule {1000 * m['schedule_s']:.1f}, execute "
                  f"{1000 * m['execute_s']:.0f} (saves {1000 * m['save_s']:.1f}), tier wait "
                  f"{1000 * m['tier_wait_s']:.1f} ms", flush=True)
    return summarize(raw)


def prefill_steps(steps: list[dict]) -> dict:
    """A group's steps until its prompts are computed (through the last with a prefill chunk),
    totalled: their count, prefill tokens, tier loads started, and seconds scheduling, executing
    (the engine thread's tier saves among them) and waiting for tier reads."""
    last = max((i for i, s in enumerate(steps) if s["prefill"]), default=-1)
    mine = steps[:last + 1]
    return dict(steps=len(mine), tokens=sum(n for s in mine for _, n, _ in s["prefill"]),
                loads=sum(s["loads"] for s in mine), **{k: sum(s[k] for s in mine) for k in
                                                         ("schedule_s", "execute_s", "save_s", "tier_wait_s")})


def arrive_apart(llm: LLM, prompts: list[list[int]], params: SamplingParams, gap: float) -> list:
    """A group's requests arriving `gap` seconds apart (the engine stepping in between, as a
    server's loop does): later ones come while earlier ones run. Returns their final outputs."""
    engine, start, done = llm.engine, time.perf_counter(), {}
    ids = [f"{start}-{i}" for i in range(len(prompts))]
    pending = list(zip(ids, prompts))
    while pending or engine.has_unfinished_requests():
        while pending and time.perf_counter() - start >= (len(prompts) - len(pending)) * gap:
            rid, prompt = pending.pop(0)
            engine.add_request(rid, {"prompt_token_ids": prompt}, params)
        if not engine.has_unfinished_requests():
            time.sleep(0.005)
            continue
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return [done[rid] for rid in ids]


TIER_COUNTERS = ("queries", "hits", "blocks_loaded", "blocks_saved", "load_failures", "bytes_read", "host_loads")


def summarize(raw: dict) -> dict:
    """A run's reported figures from its raw totals (one engine's, or several parts' added up)."""
    ttfts, wall, tiered = raw["ttfts"], raw["wall_s"], raw["tiered"]
    queries = raw["queries"]
    return dict(raw, requests=len(ttfts), mean_ttft_s=statistics.fmean(ttfts), median_ttft_s=statistics.median(ttfts),
                output_tok_s=raw["generated"] / wall, requests_s=len(ttfts) / wall,
                prefix_cache_hit_rate=raw["prefix_cache_hits"] / max(1, raw["prefix_cache_queries"]),
                tier_hit_rate=raw["hits"] / queries if tiered and queries else None,
                tier_blocks_loaded=raw["blocks_loaded"] if tiered else None,
                tier_blocks_saved=raw["blocks_saved"] if tiered else None,
                tier_load_failures=raw["load_failures"] if tiered else None,
                tier_bytes_read=raw["bytes_read"] if tiered else None,
                tier_host_loads=raw["host_loads"] if tiered else None,
                tier_bytes_read_per_s=raw["bytes_read"] / wall if tiered and queries else None)


def merge(earlier: dict | None, later: dict) -> dict:
    """Two parts of one run (--turn-range: turns run by separate engines, one after the other)."""
    if earlier is None:
        return later
    raw = {k: earlier[k] + later[k] for k in ("ttfts", "wall_s", "generated", "prompt_tokens", "prefix_cache_queries",
                                              "prefix_cache_hits", "num_evicted_blocks", *TIER_COUNTERS)}
    steps = {**earlier.get("turn_steps", {}), **later.get("turn_steps", {})}
    return summarize(dict(raw, tiered=later["tiered"], **({"turn_steps": steps} if steps else {})))


def drop_pages(directory: str) -> None:
    """The tier files' pages out of the page cache (the next read goes to the disk)."""
    os.sync()
    for f in Path(directory).glob("*.kvb"):
        with open(f, "rb") as fh:
            os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def read_bandwidth(directory: str) -> dict:
    """Bytes/s reading every tier file once with its pages dropped first (the disk), then again
    (the page cache)."""
    files = sorted(Path(directory).glob("*.kvb"))
    if not files:
        return {}
    out = {}
    for name, drop in (("cold_read_bytes_s", True), ("warm_read_bytes_s", False)):
        if drop:
            drop_pages(directory)
        total = 0
        start = time.perf_counter()
        for f in files:
            with open(f, "rb", buffering=0) as fh:
                total += len(fh.read())
        out[name] = total / (time.perf_counter() - start)
    out.update(files=len(files), bytes=sum(f.stat().st_size for f in files))
    return out


def same_share(a: list[Session], b: list[Session]) -> float:
    """The share of turns whose answers agree (the model's dtype is bf16: a history recomputed in
    one prefill chunk rounds otherwise than the decode steps that first wrote it, so near ties may
    part, and a parted answer changes that session's later prompts)."""
    pairs = [(x, y) for s, t in zip(a, b) for x, y in zip(s.answers, t.answers)]
    return sum(x == y for x, y in pairs) / len(pairs)


def copy_sessions(sessions: list[Session]) -> list[Session]:
    return [Session(list(s.history), s.users, list(s.answers)) for s in sessions]


def save_sessions(path: Path, sessions: list[Session]) -> None:
    path.write_text(json.dumps([dict(history=s.history, users=s.users, answers=s.answers) for s in sessions]))


def load_sessions(path: Path) -> list[Session]:
    if not path.exists():
        sys.exit(f"{path} is missing: run --part no-tier and --part tier first, with the same --dir")
    return [Session(d["history"], d["users"], d["answers"]) for d in json.loads(path.read_text())]


def warm_shared_prompt(llm: LLM, sessions: list[Session], args) -> None:
    """--warm: the shared prompt prefilled once, untimed (a server's steady state: the first
    session's first turn would otherwise carry the whole system prompt's prefill in both runs)."""
    if args.warm:
        llm.generate([{"prompt_token_ids": sessions[0].history[:args.system]}],
                     SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the default model (SmolLM2-135M-Instruct, Q4_1)")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--sessions", type=int, default=32)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system", type=int, default=1024, help="tokens of the shared system prompt and tool list")
    ap.add_argument("--user", type=int, default=32, help="tokens of each turn's new user message (tool output)")
    ap.add_argument("--answer", type=int, default=32, help="tokens generated per turn")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--pool-share", type=float, default=0.25, help="the KV pool as a share of the working set")
    ap.add_argument("--cpu-gb", type=float, default=None,
                    help="a host-memory tier above the disk tier (--kv-offload-cpu-gb) in the tier runs")
    ap.add_argument("--dir", default=None, help="the tier's directory (default: a new one under /tmp, removed after)")
    ap.add_argument("--warm", action="store_true",
                    help="prefill the shared prompt once, untimed, before the no-tier and tier runs' turns")
    ap.add_argument("--part", choices=("all", "no-tier", "tier", "restart"), default="all",
                    help="one run (restart: both restart runs) per call, so each fits a 5-minute timed run; needs "
                         "--dir (the tier's files and the sessions between calls); results merge into --out")
    ap.add_argument("--partial-blocks", action="store_true",
                    help="--enable-partial-block-caching in every run: a turn takes over the previous answer's "
                         "last, partly computed block instead of computing its tokens again")
    ap.add_argument("--turn-range", default=None, metavar="A:B",
                    help="with --part no-tier or tier: only turns A..B-1 (a fresh engine; the sessions go on from the "
                         "part before, the results add up), so a larger run fits 5-minute timed parts")
    ap.add_argument("--max-num-seqs", type=int, default=None,
                    help="the engines' max_num_seqs: below --concurrency a group's requests queue behind the "
                         "running ones (the tier's read-ahead overlaps their reads with the others' compute)")
    ap.add_argument("--arrival-gap", type=float, default=0.0, metavar="S",
                    help="a group's requests arrive S seconds apart instead of at once (later ones queue behind "
                         "the running ones: the tier's read-ahead starts their reads on arrival)")
    ap.add_argument("--skip-cold", action="store_true",
                    help="with --part restart: the restarted tier run only (an A/B of the tier's code)")
    ap.add_argument("--drop-pages", action="store_true",
                    help="with --part restart: drop the tier files' pages first (posix_fadvise), so reads go to the disk")
    ap.add_argument("--step-log", action="store_true",
                    help="time each turn's steps to its first tokens (scheduling, forward, the tier's saves and "
                         "waits; kv_tier_profile.StepLog) and print their means per turn (JSON: turn_steps)")
    ap.add_argument("--quick", action="store_true", help="8 sessions x 2 turns")
    ap.add_argument("--out", default=str(RESULTS / "kv_tier.json"))
    args = ap.parse_args()
    if args.quick:
        args.sessions, args.turns, args.out = 8, 2, str(RESULTS / "kv_tier_quick.json")
    if args.part != "all" and args.dir is None:
        ap.error("--part needs --dir")
    first, last = map(int, args.turn_range.split(":")) if args.turn_range else (0, args.turns)
    if args.turn_range and (args.part not in ("no-tier", "tier") or not 0 <= first < last <= args.turns):
        ap.error("--turn-range A:B needs --part no-tier or tier and 0 <= A < B <= --turns")
    B = 16
    working_set = cdiv(args.system, B) + args.sessions * cdiv(args.turns * (args.user + args.answer), B)
    # At least the shared prompt and --concurrency requests' histories (the last turn's, with its
    # answer), above the admission watermark (5%): a group's requests are admitted together.
    blocks = max(int(working_set * args.pool_share),
                 int((cdiv(args.system, B) + args.concurrency * (cdiv((args.turns + 1) * (args.user + args.answer), B)
                                                                  + 1)) / 0.95) + 1)
    engine = dict(model=args.model, load_format=args.load_format, quantization=args.quantization, dtype=args.dtype,
                  num_gpu_blocks_override=blocks, block_size=B, max_model_len=args.system + (args.turns + 2) * (
                      args.user + args.answer), enable_partial_block_caching=args.partial_blocks)
    if args.max_num_seqs is not None:
        engine["max_num_seqs"] = args.max_num_seqs
    tier_dir = args.dir or tempfile.mkdtemp(prefix="kv_tier_bench_")
    state = Path(tier_dir) / "sessions"
    if args.part in ("all", "no-tier") and first == 0:
        shutil.rmtree(tier_dir, ignore_errors=True)
        state.mkdir(parents=True)
    tier = dict(engine, kv_offload_path=tier_dir, kv_offload_gb=64, kv_offload_cpu_gb=args.cpu_gb)
    previous = json.loads(Path(args.out).read_text()) if (args.part not in ("all", "no-tier") or first > 0) and \
        Path(args.out).exists() else {}
    runs, same_tokens = dict(previous.get("runs", {})), dict(previous.get("same_tokens", {}))

    turns = range(first, last)
    if args.part in ("all", "no-tier"):
        llm = LLM(**engine)
        if first == 0:
            sessions = make_sessions(args, llm.engine.vocab_size)
            save_sessions(state / "start.json", sessions)
        base = copy_sessions(sessions if first == 0 else load_sessions(state / "no_tier.json"))
        warm_shared_prompt(llm, base, args)
        runs["no tier"] = merge(runs.get("no tier") if first else None, run_turns(llm, base, turns, args))
        save_sessions(state / "no_tier.json", base)
        del llm
    if args.part in ("all", "tier"):
        sessions = load_sessions(state / ("start.json" if first == 0 else "tier.json"))
        llm = LLM(**tier)
        tiered = copy_sessions(sessions)
        warm_shared_prompt(llm, tiered, args)
        runs["tier"] = merge(runs.get("tier") if first else None, run_turns(llm, tiered, turns, args))
        same_tokens["tier vs no tier"] = same_share(load_sessions(state / "no_tier.json"), tiered)
        save_sessions(state / "tier.json", tiered)
        llm.shutdown()
        del llm
    disk = previous.get("disk", {})
    if args.part in ("all", "restart"):
        tiered = load_sessions(state / "tier.json")
        if args.drop_pages:
            drop_pages(tier_dir)
        llm = LLM(**tier)                      # the restarted server: its index from the directory
        restarted = copy_sessions(tiered)
        runs["restart, tier"] = run_turns(llm, restarted, range(args.turns, args.turns + 1), args)
        llm.shutdown()
        del llm
        if not args.skip_cold:
            llm = LLM(**engine)
            cold = copy_sessions(tiered)
            runs["restart, cold"] = run_turns(llm, cold, range(args.turns, args.turns + 1), args)
            del llm
            same_tokens["restart: tier vs cold"] = same_share(restarted, cold)
            disk = read_bandwidth(tier_dir)
        if args.dir is None:
            shutil.rmtree(tier_dir, ignore_errors=True)

    history_blocks = args.sessions * cdiv(args.turns * (args.user + args.answer), B)
    room = blocks - cdiv(args.system, B)
    print(f"{args.sessions} sessions x {args.turns} turns (+1 after the restart), system {args.system} tokens, "
          f"user {args.user}, answer {args.answer}, concurrency {args.concurrency}{', shared prompt warmed' if args.warm else ''}; "
          f"pool {blocks} blocks of {B} = {blocks / working_set:.2f} of the working set ({working_set} blocks); "
          f"the sessions' histories ({history_blocks} blocks) = {history_blocks / room:.1f}x the pool's room beside "
          f"the shared prompt ({room} blocks)")
    print(f"{'run':15} {'mean TTFT':>10} {'median':>8} {'out tok/s':>10} {'req/s':>7} {'tier hit':>9} "
          f"{'read MB/s':>10} {'loaded':>7} {'failed':>7}")
    for name, r in runs.items():
        hit = "-" if r["tier_hit_rate"] is None else f"{100 * r['tier_hit_rate']:.1f}%"
        rate = "-" if r["tier_bytes_read_per_s"] is None else f"{r['tier_bytes_read_per_s'] / 1e6:.1f}"
        print(f"{name:15} {r['mean_ttft_s'] * 1000:8.0f}ms {r['median_ttft_s'] * 1000:6.0f}ms "
              f"{r['output_tok_s']:10.1f} {r['requests_s']:7.2f} {hit:>9} {rate:>10} "
              f"{r['tier_blocks_loaded'] if r['tier_blocks_loaded'] is not None else '-':>7} "
              f"{r['tier_load_failures'] if r['tier_load_failures'] is not None else '-':>7}")
    ttft = restart = None
    if "no tier" in runs and "tier" in runs:
        ttft = runs["no tier"]["mean_ttft_s"] / runs["tier"]["mean_ttft_s"]
        print(f"mean TTFT: {ttft:.2f}x lower with the tier; throughput "
              f"{runs['tier']['output_tok_s'] / runs['no tier']['output_tok_s']:.2f}x")
    if "restart, tier" in runs and "restart, cold" in runs:
        restart = runs["restart, cold"]["mean_ttft_s"] / runs["restart, tier"]["mean_ttft_s"]
        print(f"after a restart {restart:.2f}x lower than cold")
    if same_tokens:
        print("answers alike: " + ", ".join(f"{k} {100 * v:.0f}%" for k, v in same_tokens.items()))
    if disk:
        print(f"tier directory: {disk['files']} files, {disk['bytes'] / 1e6:.1f} MB; read bandwidth "
              f"{disk['cold_read_bytes_s'] / 1e6:.0f} MB/s cold, {disk['warm_read_bytes_s'] / 1e6:.0f} MB/s warm")
    result = dict(args={k: v for k, v in vars(args).items() if k != "part"}, cpu_model=cpu_model(),
                  cpu_flags=cpu_flags(), threads=os.cpu_count(), pool_blocks=blocks, working_set_blocks=working_set,
                  history_blocks=history_blocks, pool_room_blocks=room, runs=runs, ttft_ratio=ttft,
                  restart_ttft_ratio=restart, same_tokens=same_tokens, disk=disk)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"CPU: {result['cpu_model']} ({' '.join(result['cpu_flags'])}); wrote {args.out}")


if __name__ == "__main__":
    main()
