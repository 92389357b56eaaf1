"""`pagedserve bench serve`: an async client sends a seeded workload to the OpenAI-compatible
server and reports what `vllm bench serve` does.

    pagedserve bench serve --num-prompts 64 --input-len 128 --output-len 64      # starts its own server
    pagedserve bench serve --dataset-name sharegpt-like --num-prompts 100 --request-rate 1
    pagedserve bench serve --base-url http://127.0.0.1:8000 --percentile-metrics ttft,tpot,itl,e2el
    pagedserve bench serve --baseline        # and again on a --max-num-seqs 1 server: the ratios

Each request is a streamed /v1/completions call that generates exactly its output length
(ignore_eos). --dataset-name random (default): prompts of exactly --input-len tokens (seeded
random English words, cut to length with /tokenize), --output-len generated tokens;
sharegpt-like / alpaca-like: the paper's length statistics (pagedserve/bench/datasets.py; random
token ids below --vocab-size). Requests arrive as a Poisson process at --request-rate per second
(inf: all at once), at most --max-concurrency in flight. Metrics (--percentile-metrics, each with
mean, median and the --metric-percentiles):
  TTFT  time to the first streamed token
  TPOT  (latency - TTFT) / (output tokens - 1), per request
  ITL   gaps between consecutive streamed chunks (one chunk per engine step)
  E2EL  request latency
Unless --base-url is given it starts `pagedserve serve` itself on a free port (--model,
--server-args).
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

from pagedserve.bench import report
from pagedserve.bench.datasets import DATASETS, TraceRequest, dataset_trace
from pagedserve.server.launcher import launch_server

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
    if args.dataset_name != "random":
        return dataset_trace(args.dataset_name, args.num_prompts, args.input_len, args.output_len, args.seed,
                             args.vocab_size, max_model_len, args.request_rate)
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


METRICS = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
           "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}


def summarize(results: list[RequestResult], duration: float, before: dict, after: dict, metrics: list[str],
              which: list[float]) -> dict:
    ok = [r for r in results if r.ok]
    values = {"ttft": [r.ttft for r in ok],
              "tpot": [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1],
              "itl": [x for r in ok for x in r.itl], "e2el": [r.latency for r in ok]}
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    summary = {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
    }
    for name in metrics:
        stats = report.percentiles([1000 * x for x in values[name]], which)
        summary.update({f"{stat}_{name}_ms": v for stat, v in stats.items()})
    steps = after.get("pagedserve:iteration_tokens_total_count", 0) - before.get(
        "pagedserve:iteration_tokens_total_count", 0)
    gen = after.get("pagedserve:generation_tokens_total", 0) - before.get("pagedserve:generation_tokens_total", 0)
    summary["engine_steps"] = steps
    summary["mean_generated_tokens_per_step"] = gen / steps if steps else float("nan")
    errors = sorted({r.error for r in results if r.error})
    if errors:
        summary["errors"] = errors[:5]
    return summary


def print_table(s: dict, metrics: list[str], which: list[float], label: str = "") -> None:
    """The run's summary as `vllm bench serve` lays it out."""
    print(report.title("Serving Benchmark Result" + (f" ({label})" if label else "")))
    report.print_totals(s["completed"], s["duration_s"], s["total_input_tokens"], s["total_output_tokens"])
    print(report.row("Failed requests", s["failed"], "{:d}"))
    print(report.row("Generated tokens per engine step", s["mean_generated_tokens_per_step"]))
    for name in metrics:
        print(report.title(METRICS[name], "-"))
        print(report.row(f"Mean {name.upper()} (ms)", s[f"mean_{name}_ms"]))
        print(report.row(f"Median {name.upper()} (ms)", s[f"median_{name}_ms"]))
        for p in which:
            print(report.row(f"P{p:g} {name.upper()} (ms)", s[f"p{p:g}_{name}_ms"]))
    print("=" * report.WIDTH)


def bench_one(args, label: str, extra_server_args: list[str]) -> dict:
    if args.base_url:
        results, duration, before, after = asyncio.run(run_workload(args.base_url, args.served_model, args))
        return summarize(results, duration, before, after, args.metrics, args.percentiles)
    server_args = shlex.split(args.server_args) + extra_server_args + ["--disable-uvicorn-access-log"]
    log = Path(tempfile.mkdtemp(prefix="pagedserve-bench-")) / f"{label}.log"
    print(f"[{label}] starting: pagedserve serve {args.model or ''} {' '.join(server_args)}  (log: {log})",
          file=sys.stderr)
    with launch_server(args.model, server_args, log, timeout=600) as server:
        results, duration, before, after = asyncio.run(run_workload(server.url, None, args))
    return summarize(results, duration, before, after, args.metrics, args.percentiles)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default=None, help="benchmark a running server instead of starting one")
    p.add_argument("--served-model", default=None, help="model name to send (default: the server's first)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--model", default=None, help="model of the server this starts (default: SmolLM2)")
    p.add_argument("--server-args", default="", help="extra `pagedserve serve` flags, one string")
    p.add_argument("--dataset-name", default="random", choices=DATASETS, help="the requests' lengths (default: random)")
    p.add_argument("--vocab-size", type=int, default=49152, help="token ids of the -like datasets")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128, help="random: prompt tokens per request (default: 128)")
    p.add_argument("--output-len", type=int, default=64, help="random: generated tokens per request (default: 64)")
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s, Poisson; inf: all at once")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl",
                   help="comma-separated, of ttft, tpot, itl, e2el (default: ttft,tpot,itl)")
    p.add_argument("--metric-percentiles", default="99", help="comma-separated percentiles (default: 99)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--baseline", action="store_true",
                   help="run it again on a --max-num-seqs 1 server (no batching across clients): the ratios")
    p.add_argument("--output-json", default=None, help="write the result as JSON here")


def run(args: argparse.Namespace) -> int:
    args.metrics = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    unknown = [m for m in args.metrics if m not in METRICS]
    if unknown:
        sys.exit(f"pagedserve bench serve: --percentile-metrics: unknown {', '.join(unknown)}; "
                 f"expected some of {', '.join(METRICS)}")
    args.percentiles = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
    runs = {"continuous": bench_one(args, "continuous", [])}
    if args.baseline and not args.base_url:
        runs["max-num-seqs 1"] = bench_one(args, "max-num-seqs-1", ["--max-num-seqs", "1"])
    lengths = (f"{args.input_len} prompt + {args.output_len} output tokens" if args.dataset_name == "random"
               else f"{args.dataset_name} lengths")
    print(f"\nworkload: {args.num_prompts} requests, {lengths}, rate {args.request_rate}/s, "
          f"max concurrency {args.max_concurrency or 'unlimited'}, seed {args.seed}")
    for label, summary in runs.items():
        print_table(summary, args.metrics, args.percentiles, label if len(runs) > 1 else "")
    if len(runs) == 2:
        a, b = runs.values()
        print(report.row("Output throughput, continuous / max-num-seqs 1",
                         a["output_throughput"] / b["output_throughput"], "{:.2f}x"))
    report.write_json(args.output_json, {"runs": runs}, vars(args))
    return 0 if all(r["failed"] == 0 for r in runs.values()) else 1
