"""Tensor parallelism on this machine: offline throughput and single-stream latency for
TP = 1, 2, 3 with the same total threads, and the time the driver spends in collectives.

    .venv/bin/python benchmarks/tensor_parallel.py              # default model, TP 1 2 3 (the lead's run)
    .venv/bin/python benchmarks/tensor_parallel.py --quick      # a smoke run (tiny workload)
    .venv/bin/python benchmarks/tensor_parallel.py --tp 1 2 --backend ray

A TP size the model does not split into is skipped and said so (the default model's 9
heads split over 1, 3 or 9 ranks, not 2). Each TP size runs in this process in turn (rank 0 here, the other ranks in their own
processes); `--threads` total threads are split evenly between the ranks (at least one
each, so TP 3 on 2 cores oversubscribes them: reported as is). The all-reduce and gather
time is the driver's wall time inside them: it includes waiting for the slowest rank.
It also prints the communication a step implies for Llama-2-13B and 70B (arithmetic, no
measurement): per token, 2 all-reduces per layer plus the embedding's, of hidden-size
activations, and the sampled rows' logits gathered on the driver.
Writes benchmarks/results/tensor_parallel[_quick].json and prints a markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pagedserve.bench.throughput import decode_step_times  # noqa: E402
from benchmarks.workloads import make_trace  # noqa: E402

# name: (hidden size, layers, vocabulary) of models TP is for.
BIG_MODELS = {"Llama-2-13B": (5120, 40, 32000), "Llama-2-70B": (8192, 80, 32000)}


class CollectiveTimer:
    """Wraps the driver's all_reduce and gather_columns, summing their wall time."""

    def __init__(self, group) -> None:
        self.seconds, self.calls = 0.0, 0
        for name in ("all_reduce", "gather_columns"):
            setattr(group, name, self._timed(getattr(group, name)))

    def _timed(self, fn):
        def timed(x):
            start = time.perf_counter()
            try:
                return fn(x)
            finally:
                self.seconds += time.perf_counter() - start
                self.calls += 1
        return timed


def run_offline(llm, trace) -> dict:
    from pagedserve import SamplingParams
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in trace]
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in trace]
    steps = _count_steps(llm)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return dict(seconds=elapsed, output_tokens=n_out, output_tok_s=n_out / elapsed, steps=steps())


def _count_steps(llm):
    engine, count = llm.engine, [0]
    step = engine.step

    def counted():
        count[0] += 1
        return step()
    engine.step = counted
    return lambda: count[0]


def run_single(llm, prompt_len: int, output_len: int) -> dict:
    from pagedserve import SamplingParams
    prompt = (make_trace("sharegpt", 1, seed=1)[0].prompt_token_ids * 64)[:prompt_len]
    engine = llm.engine
    engine.add_request("single", {"prompt_token_ids": prompt},
                       SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True))
    steps = decode_step_times(engine)
    return dict(ms_per_token=sorted(steps)[len(steps) // 2] * 1e3)


def rss_mib(pid: int) -> float:
    """Resident memory of a rank's process (Linux); rank 0's includes the engine and tokenizer."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def comm_per_token(hidden: int, layers: int, vocab: int, tp: int, dtype_bytes: int = 2) -> dict:
    """Bytes a rank sends per token in a step: ring all-reduces (2 (N-1)/N of the data each)
    of the embedding and of each layer's attention and MLP outputs; the logits' gather (float32,
    sampled rows only) is sent by every rank but the driver."""
    reduced = (2 * layers + 1) * hidden * dtype_bytes
    return dict(all_reduce_bytes=reduced, sent_per_rank_bytes=reduced * 2 * (tp - 1) / tp,
                gathered_logit_bytes=vocab * 4 * (tp - 1) / tp)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--backend", default="mp", choices=["mp", "ray"])
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="total, split between ranks")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--num-requests", type=int, default=64, help="alpaca-like requests, all at once")
    ap.add_argument("--single-prompt-len", type=int, default=128)
    ap.add_argument("--single-output-len", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="a smoke run: 4 requests, 8 tokens single stream")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.quick:
        args.num_requests, args.single_output_len, args.single_prompt_len = 4, 8, 32

    from pagedserve import LLM
    trace = make_trace("alpaca", args.num_requests, seed=0)
    rows, skipped = [], []
    for tp in args.tp:
        threads = max(1, args.threads // tp)
        try:
            llm = LLM(args.model, dtype=args.dtype, tensor_parallel_size=tp, threads_per_rank=threads,
                      distributed_executor_backend=args.backend if tp > 1 else None, kv_cache_memory=512 * 1024**2)
        except ValueError as e:
            print(f"TP {tp} skipped: {e}", file=sys.stderr)
            skipped.append(dict(tp=tp, reason=str(e)))
            continue
        try:
            group = getattr(llm.engine.executor, "group", None)
            timer = CollectiveTimer(group) if group else None
            offline = run_offline(llm, trace)
            collective_s = timer.seconds if timer else 0.0
            single = run_single(llm, args.single_prompt_len, args.single_output_len)
            rss = [rss_mib(pid) for pid in [os.getpid(), *llm.engine.executor.worker_pids()]]
        finally:
            llm.shutdown()
        rows.append(dict(tp=tp, threads_per_rank=threads, **offline, **single, rss_mib_per_rank=rss,
                         collective_seconds=collective_s,
                         collective_ms_per_step=collective_s / max(1, offline["steps"]) * 1e3,
                         collective_share=collective_s / offline["seconds"]))
    comm = {name: {tp: comm_per_token(*shape, tp) for tp in (2, 4, 8)} for name, shape in BIG_MODELS.items()}
    out = Path(args.json or f"benchmarks/results/tensor_parallel{'_quick' if args.quick else ''}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(args=vars(args), runs=rows, skipped=skipped, comm_per_token=comm), indent=2))

    print(f"\n{args.num_requests} alpaca-like requests at once, {args.dtype}, {args.threads} threads in all "
          f"({args.backend} backend)\n")
    print("| TP | threads/rank | output tok/s | single stream ms/token | collectives ms/step (driver) | "
          "share of the run | RSS per rank (MiB) |")
    print("|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['tp']} | {r['threads_per_rank']} | {r['output_tok_s']:.1f} | {r['ms_per_token']:.2f} | "
              f"{r['collective_ms_per_step']:.2f} | {r['collective_share']:.1%} | "
              f"{', '.join(f'{m:.0f}' for m in r['rss_mib_per_rank'])} |")
    for r in skipped:
        print(f"| {r['tp']} | skipped: {r['reason']} | | | | | |")
    print("\nCommunication per token per step (bf16 activations; arithmetic):\n")
    print("| model | TP | all-reduced per token | sent per rank per token | logits gathered per sampled token |")
    print("|---|---:|---:|---:|---:|")
    for name, by_tp in comm.items():
        for tp, c in by_tp.items():
            print(f"| {name} | {tp} | {c['all_reduce_bytes'] / 1024:.0f} KiB | {c['sent_per_rank_bytes'] / 1024:.0f} KiB"
                  f" | {c['gathered_logit_bytes'] / 1024:.0f} KiB |")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
