"""`pagedserve bench latency`: one batch of --batch-size requests of --input-len prompt tokens,
each generating --output-len tokens, timed end to end --num-iters times after --num-iters-warmup
untimed runs (as `vllm bench latency`)."""
from __future__ import annotations

import argparse
import time

from pagedserve.bench import report
from pagedserve.bench.datasets import random_trace

PERCENTILES = [10, 25, 50, 75, 90, 99]


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens per request (default: 32)")
    p.add_argument("--output-len", type=int, default=128, help="generated tokens per request (default: 128)")
    p.add_argument("--batch-size", type=int, default=8, help="requests per batch (default: 8)")
    p.add_argument("--n", type=int, default=1, help="completions per request (default: 1)")
    p.add_argument("--num-iters-warmup", type=int, default=2, help="untimed runs first (default: 2)")
    p.add_argument("--num-iters", type=int, default=5, help="timed runs (default: 5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None, help="write the result as JSON here")


def run(config, opts: argparse.Namespace) -> dict:
    from pagedserve import LLM, SamplingParams
    llm = LLM.from_config(config)
    vocab = llm.engine.model_args.vocab_size
    trace = random_trace(opts.batch_size, opts.input_len, opts.output_len, opts.seed, vocab)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in trace]
    params = SamplingParams(n=opts.n, temperature=1.0 if opts.n > 1 else 0.0, max_tokens=opts.output_len,
                            ignore_eos=True, seed=opts.seed)

    def once() -> float:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    for _ in range(opts.num_iters_warmup):
        once()
    latencies = [once() for _ in range(opts.num_iters)]
    llm.shutdown()
    stats = report.percentiles(latencies, PERCENTILES)
    tokens = opts.batch_size * opts.n * opts.output_len
    result = {"avg_latency": stats["mean"], "latencies": latencies,
              "percentiles": {str(p): stats[f"p{p}"] for p in PERCENTILES},
              "output_tokens_per_s": tokens / stats["mean"]}
    print(report.title("Latency Benchmark Result"))
    print(report.row("Batch size x prompt + output tokens", f"{opts.batch_size} x {opts.input_len}+{opts.output_len}"))
    print(report.row("Avg latency (s)", stats["mean"], "{:.4f}"))
    for p in PERCENTILES:
        print(report.row(f"P{p} latency (s)", stats[f"p{p}"], "{:.4f}"))
    print(report.row("Output token throughput (tok/s)", result["output_tokens_per_s"], "{:.1f}"))
    print("=" * report.WIDTH)
    report.write_json(opts.output_json, result, {**vars(opts), "engine": vars(config)})
    return result
