"""Serving benchmark: an async client sends a seeded workload to the OpenAI-compatible server.

    .venv/bin/python benchmarks/serve.py --quick                 # start the servers itself, small run
    .venv/bin/python benchmarks/serve.py --num-prompts 200 --request-rate 4
    .venv/bin/python benchmarks/serve.py --workload sharegpt --num-prompts 100 --request-rate 1
    .venv/bin/python benchmarks/serve.py --base-url http://127.0.0.1:8000 --no-baseline

Each request is a streamed /v1/completions call that generates exactly its
output length (ignore_eos). Workload `random` (default): prompts of exactly
--input-len tokens (seeded random English words, cut to length with /tokenize),
--output-len generated tokens. Workloads `sharegpt` / `alpaca`: the paper's
length statistics from benchmarks/workloads.py (random token ids below
--vocab-size). Requests arrive as a Poisson process at --request-rate per second
(inf: all at once), at most --max-concurrency in flight. Metrics follow
`vllm bench serve`:
  TTFT  time to the first streamed token
  ITL   gaps between consecutive streamed chunks (one chunk per engine step)
  TPOT  (latency - TTFT) / (output tokens - 1), per request
  E2EL  request latency
Unless --base-url is given, the script starts `pagedserve serve` itself on a
free port, and (unless --no-baseline) runs the same workload a second time on a
server with --max-num-seqs 1 (one request at a time: no batching across
clients), and reports the ratios. Prints a table, writes JSON.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.workloads import WORKLOADS, TraceRequest, make_trace  # noqa: E402
from pagedserve.server.launcher import launch_server  # noqa: E402

WORDS = ("the of and to in is was that for on with as by at from it an be this which or are his have had not "
         "but first one their new after also who they two her has been other when there all during into school "
         "time may years more most only over city some world would where later up such used many can state "
         "about national out known university united then made however through american including these "
         "under well team since while both film three page year being around number series because family "
         "early each released season government each like what so any system called until group general").split()


@dataclass
class RequestResult:
    ok: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


async def make_requests(client: httpx.AsyncClient, args, max_model_len: int) -> list[TraceRequest]:
    if args.workload in WORKLOADS:
        return make_trace(args.workload, args.num_prompts, args.seed, args.vocab_size, max_model_len,
                          args.request_rate)
    rng = random.Random(args.seed)
    requests, t = [], 0.0
    for _ in range(args.num_prompts):
        text = " ".join(rng.choice(WORDS) for _ in range(args.input_len * 2))
        r = await client.post("/tokenize", json={"prompt": text, "add_special_tokens": False})
        r.raise_for_status()
        if not math.isinf(args.request_rate):
            t += rng.expovariate(args.request_rate)
        requests.append(TraceRequest(r.json()["tokens"][:args.input_len], args.output_len, t))
    return requests


async def one_request(client: httpx.AsyncClient, model: str, prompt: list[int], output_len: int,
                      temperature: float) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": temperature,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    res = RequestResult(prompt_len=len(prompt))
    start = time.perf_counter()
    last = start
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = chunk["error"]["message"]
                    return res
                now = time.perf_counter()
                if chunk.get("choices"):   # a step's tokens (the last chunk only carries usage)
                    if res.ttft == 0.0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
        res.latency = time.perf_counter() - start
        res.ok = res.output_tokens > 0
    except (httpx.HTTPError, OSError) as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run_workload(base_url: str, model: str | None, args) -> tuple[list[RequestResult], float, dict, dict]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(base_url=base_url, timeout=None, limits=limits, headers=headers) as client:
        card = (await client.get("/v1/models")).json()["data"][0]
        model = model or card["id"]
        requests = await make_requests(client, args, card["max_model_len"])
        # Warm up (first-call costs), then measure.
        await one_request(client, model, requests[0].prompt_token_ids, 4, args.temperature)
        before = parse_metrics((await client.get("/metrics")).text)
        limit = asyncio.Semaphore(args.max_concurrency or len(requests))

        async def limited(req: TraceRequest):
            async with limit:
                return await one_request(client, model, req.prompt_token_ids, req.output_len, args.temperature)

        start = time.perf_counter()
        tasks = []
        for req in requests:
            delay = start + req.arrival_time - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(limited(req)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        after = parse_metrics((await client.get("/metrics")).text)
    return results, duration, before, after


def parse_metrics(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name.split("{")[0]] = out.get(name.split("{")[0], 0.0) + float(value)
    return out


def summarize(results: list[RequestResult], duration: float, before: dict, after: dict) -> dict:
    ok = [r for r in results if r.ok]
    ms = lambda xs: [1000 * x for x in xs]  # noqa: E731
    ttft = ms([r.ttft for r in ok])
    tpot = ms([(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1])
    itl = ms([x for r in ok for x in r.itl])
    e2el = ms([r.latency for r in ok])
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    summary = {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
    }
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2el)):
        arr = np.array(xs) if xs else np.array([float("nan")])
        summary.update({f"mean_{name}_ms": float(arr.mean()), f"median_{name}_ms": float(np.median(arr)),
                        f"p99_{name}_ms": float(np.percentile(arr, 99))})
    steps = after.get("pagedserve:iteration_tokens_total_count", 0) - before.get(
        "pagedserve:iteration_tokens_total_count", 0)
    gen = after.get("pagedserve:generation_tokens_total", 0) - before.get("pagedserve:generation_tokens_total", 0)
    summary["engine_steps"] = steps
    summary["mean_generated_tokens_per_step"] = gen / steps if steps else float("nan")
    errors = sorted({r.error for r in results if r.error})
    if errors:
        summary["errors"] = errors[:5]
    return summary


ROWS = [("completed", "Successful requests", "{:.0f}"), ("failed", "Failed requests", "{:.0f}"),
        ("duration_s", "Benchmark duration (s)", "{:.2f}"),
        ("request_throughput", "Request throughput (req/s)", "{:.3f}"),
        ("output_throughput", "Output token throughput (tok/s)", "{:.1f}"),
        ("total_token_throughput", "Total token throughput (tok/s)", "{:.1f}"),
        ("mean_generated_tokens_per_step", "Generated tokens per engine step", "{:.2f}")] + [
    (f"{stat}_{m}_ms", f"{stat.capitalize()} {m.upper()} (ms)", "{:.1f}")
    for m in ("ttft", "tpot", "itl", "e2el") for stat in ("mean", "median", "p99")]


def print_table(runs: dict[str, dict]) -> None:
    names = list(runs)
    show_ratio = len(names) == 2
    header = f"{'':34}" + "".join(f"{n:>16}" for n in names) + (f"{'ratio':>10}" if show_ratio else "")
    print(header)
    print("-" * len(header))
    for key, label, fmt in ROWS:
        vals = [runs[n].get(key, float("nan")) for n in names]
        line = f"{label:34}" + "".join(f"{fmt.format(v):>16}" for v in vals)
        if show_ratio and vals[1]:
            line += f"{vals[0] / vals[1]:>9.2f}x"
        print(line)


def bench_one(args, label: str, extra_server_args: list[str]) -> dict:
    if args.base_url:
        results, duration, before, after = asyncio.run(run_workload(args.base_url, args.served_model, args))
        return summarize(results, duration, before, after)
    server_args = shlex.split(args.server_args) + extra_server_args + ["--disable-uvicorn-access-log"]
    log = Path(tempfile.mkdtemp(prefix="pagedserve-bench-")) / f"{label}.log"
    print(f"[{label}] starting: pagedserve serve {args.model or ''} {' '.join(server_args)}  (log: {log})",
          file=sys.stderr)
    with launch_server(args.model, server_args, log, timeout=600) as server:
        results, duration, before, after = asyncio.run(run_workload(server.url, None, args))
    return summarize(results, duration, before, after)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default=None, help="benchmark a running server instead of starting one")
    p.add_argument("--served-model", default=None, help="model name to send (default: the server's first)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default=None, help="model for the servers this script starts (default: SmolLM2)")
    p.add_argument("--server-args", default="", help="extra `pagedserve serve` flags, one string")
    p.add_argument("--workload", default="random", choices=["random", *WORKLOADS])
    p.add_argument("--vocab-size", type=int, default=49152, help="token ids of the sharegpt/alpaca workloads")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s, Poisson; inf: all at once")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-baseline", action="store_true", help="skip the --max-num-seqs 1 server")
    p.add_argument("--quick", action="store_true", help="16 prompts, 64 in, 32 out")
    p.add_argument("--result-file", default=str(Path(__file__).parent / "results" / "serve.json"))
    args = p.parse_args(argv)
    if args.quick:
        args.num_prompts, args.input_len, args.output_len = 16, 64, 32

    runs = {"continuous": bench_one(args, "continuous", [])}
    if not args.base_url and not args.no_baseline:
        runs["max-num-seqs 1"] = bench_one(args, "max-num-seqs-1", ["--max-num-seqs", "1"])
    print()
    lengths = (f"{args.input_len} prompt + {args.output_len} output tokens" if args.workload == "random"
               else "{} lengths".format(args.workload))
    print(f"workload: {args.num_prompts} requests, {lengths}, rate {args.request_rate}/s, "
          f"max concurrency {args.max_concurrency or 'unlimited'}, seed {args.seed}")
    print_table(runs)
    out = Path(args.result_file)
    out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: (v if not (isinstance(v, float) and math.isinf(v)) else "inf") for k, v in vars(args).items()}
    out.write_text(json.dumps({"command": " ".join(sys.argv), "config": config, "runs": runs}, indent=2))
    print(f"\nwrote {out}")
    return 0 if all(r["failed"] == 0 for r in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
