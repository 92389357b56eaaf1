"""Preemption by swap vs by recompute (the paper's Figure 19), on this machine.

    .venv/bin/python benchmarks/preemption.py              # both parts
    .venv/bin/python benchmarks/preemption.py --quick      # a smoke run
    .venv/bin/python benchmarks/preemption.py --part micro # only (a), or --part e2e for only (b)

(a) Microbenchmark, Figure 19(a): for block sizes 1..256, the time to preempt and resume one
request of --context tokens. Swap: copy its blocks out to the host pool and back in, through
the worker's own swap path (ModelRunner.move_blocks with the scheduler's block mappings).
Recompute: a prefill of the same tokens (what resuming costs; freeing costs nothing). On CPU
"device" and "host" memory are both RAM, so a swap is a gather of blocks between two tensors:
what grows with small blocks is the per-block work, as with the paper's many small PCIe copies.

(b) End to end, Figure 19(b): a sharegpt-like trace with KV memory for about a third of what
it needs at its peak, so requests are preempted over and over; throughput, mean latency and
the preemption counters for recompute vs swap, over a few block sizes. Both modes' greedy
outputs are compared (equal in float32; bfloat16 may round a recomputed prefill differently).

Writes benchmarks/results/preemption.json and preemption.png.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.workloads import make_trace  # noqa: E402

MICRO_BLOCK_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256]


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


# ---- (a) microbenchmark --------------------------------------------------------------------

def micro(args) -> list[dict]:
    from pagedserve import LLM, SamplingParams
    from pagedserve.batch import StepBatch
    from pagedserve.kv.kv_cache_manager import cdiv
    rows = []
    tokens = list(range(100, 100 + args.context))
    for B in args.block_sizes:
        blocks = cdiv(args.context + 1, B)
        llm = LLM(args.model, dtype=args.dtype, block_size=B, num_gpu_blocks_override=blocks,
                  enable_prefix_caching=False, preemption_mode="swap", num_host_blocks_override=blocks)
        runner, kv = llm.engine.runner, llm.engine.scheduler.kv
        one = SamplingParams(temperature=0, max_tokens=1)
        outs, ins, recomputes = [], [], []
        for _ in range(args.repeats):   # interleaved, so a busy machine slows both alike
            kv.allocate(1, tokens, 0, len(tokens))      # the request's table, as after its prefill
            n_blocks = kv.num_held_blocks(1)
            mapping = kv.swap.swap_out([1])                  # what the scheduler emits ...
            start = time.perf_counter()
            runner.move_blocks(StepBatch(swap_out=mapping))   # ... and the worker runs
            outs.append(time.perf_counter() - start)
            mapping = kv.swap.swap_in([1])
            start = time.perf_counter()
            runner.move_blocks(StepBatch(swap_in=mapping))
            ins.append(time.perf_counter() - start)
            kv.free(1)
            recomputes.append(best_of(lambda: llm.generate({"prompt_token_ids": tokens}, one, use_tqdm=False), 1))
        recompute = min(recomputes)
        nbytes = n_blocks * runner.kv_cache[:, :, 0].numel() * runner.kv_cache.element_size()
        row = dict(block_size=B, blocks=n_blocks, bytes=nbytes, swap_out_ms=1e3 * min(outs),
                   swap_in_ms=1e3 * min(ins), swap_ms=1e3 * (min(outs) + min(ins)), recompute_ms=1e3 * recompute)
        rows.append(row)
        print(f"  block {B:>3}: {n_blocks:>4} blocks, swap out+in {row['swap_ms']:8.2f} ms, "
              f"recompute {row['recompute_ms']:8.2f} ms", flush=True)
    return rows


# ---- (b) end to end ------------------------------------------------------------------------

def e2e_run(args, mode: str, block_size: int, trace) -> dict:
    from pagedserve import LLM, SamplingParams
    from pagedserve.kv.kv_cache_manager import cdiv
    need = [cdiv(len(r.prompt_token_ids) + r.output_len, block_size) for r in trace]
    blocks = max(max(need), int(sum(need) * args.memory_fraction))
    llm = LLM(args.model, dtype=args.dtype, block_size=block_size, num_gpu_blocks_override=blocks,
              enable_prefix_caching=False, max_num_seqs=args.max_num_seqs, preemption_mode=mode,
              num_host_blocks_override=sum(need) if mode == "swap" else None)
    engine = llm.engine
    start = time.perf_counter()
    reqs = [engine.add_request(None, {"prompt_token_ids": r.prompt_token_ids},
                               SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True))
            for r in trace]
    finals = {}
    steps = 0
    while engine.has_unfinished_requests():
        steps += 1
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    elapsed = time.perf_counter() - start
    stats = llm.kv_cache_stats()
    n_in = sum(len(r.prompt_token_ids) for r in trace)
    n_out = sum(r.output_len for r in trace)
    latency = [finals[r.request_id].metrics.finished_time - finals[r.request_id].metrics.arrival_time for r in reqs]
    # Work that does not depend on how busy the machine is: engine steps, and tokens through
    # the model (each prompt and generated token once, the last sampled one never, plus recompute).
    computed = n_in + n_out - len(trace) + stats["num_recomputed_tokens"]
    return dict(mode=mode, block_size=block_size, num_blocks=blocks, blocks_needed_at_once=sum(need), seconds=elapsed,
                steps=steps, computed_tokens=computed,
                output_tok_s=n_out / elapsed, total_tok_s=(n_in + n_out) / elapsed,
                mean_latency_s=statistics.mean(latency),
                num_preemptions=stats["num_preemptions"], num_swapped_out_blocks=stats["num_swapped_out_blocks"],
                num_swapped_in_blocks=stats["num_swapped_in_blocks"],
                num_recomputed_tokens=stats["num_recomputed_tokens"],
                outputs=[finals[r.request_id].outputs[0].token_ids for r in reqs])


def e2e(args) -> list[dict]:
    trace = make_trace("sharegpt", args.num_requests, seed=args.seed)
    if args.quick:
        for r in trace:
            r.prompt_token_ids = r.prompt_token_ids[:64]
            r.output_len = min(r.output_len, 32)
    rows = []
    for B in args.e2e_block_sizes:
        pair = {mode: e2e_run(args, mode, B, trace) for mode in ("recompute", "swap")}
        same = sum(a == b for a, b in zip(pair["recompute"]["outputs"], pair["swap"]["outputs"]))
        for mode, r in pair.items():
            r.pop("outputs")
            r["identical_outputs"] = f"{same}/{len(trace)}"
            rows.append(r)
            print(f"  block {B:>3} {mode:<9}: {r['output_tok_s']:6.1f} out tok/s, mean latency "
                  f"{r['mean_latency_s']:6.1f}s, {r['num_preemptions']} preemptions, "
                  f"{r['num_swapped_out_blocks']} blocks swapped out, {r['num_recomputed_tokens']} tokens recomputed",
                  flush=True)
    return rows


# ---- report --------------------------------------------------------------------------------

def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = [k for k in ("micro", "e2e") if k in result]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.8), squeeze=False)
    for ax, key in zip(axes[0], panels):
        rows = result[key]
        if key == "micro":
            xs = [r["block_size"] for r in rows]
            ax.plot(xs, [r["swap_ms"] for r in rows], "o-", color="tab:blue", label="swap out + in")
            ax.plot(xs, [r["recompute_ms"] for r in rows], "s-", color="tab:orange", label="recompute")
            ax.set_ylabel("time per preempted request (ms)")
            ax.set_title(f"(a) Microbenchmark ({result['context']} tokens)")
            ax.set_yscale("log")
        else:
            for mode, marker, color in (("swap", "o-", "tab:blue"), ("recompute", "s-", "tab:orange")):
                sub = [r for r in rows if r["mode"] == mode]
                ax.plot([r["block_size"] for r in sub], [r["mean_latency_s"] for r in sub], marker, color=color,
                        label=mode)
            ax.set_ylabel("mean request latency (s)")
            ax.set_title("(b) End to end under memory pressure")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("block size")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--part", choices=["micro", "e2e", "both"], default="both")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--context", type=int, default=1024, help="tokens of the preempted request in (a)")
    ap.add_argument("--block-sizes", type=int, nargs="+", default=MICRO_BLOCK_SIZES)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--e2e-block-sizes", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--memory-fraction", type=float, default=0.33,
                    help="KV blocks as a fraction of what all requests need at once")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--quick", action="store_true",
                    help="(a) 256 tokens at 3 block sizes; (b) 8 short requests at block size 16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/preemption")
    args = ap.parse_args()
    if args.quick:
        args.context, args.block_sizes, args.repeats = min(args.context, 256), [1, 16, 256], 2
        args.e2e_block_sizes, args.num_requests = [16], min(args.num_requests, 8)

    result: dict = dict(command=" ".join(sys.argv), quick=args.quick, dtype=args.dtype, context=args.context)
    if args.part in ("micro", "both"):
        print(f"(a) swap vs recompute for one request of {args.context} tokens:", flush=True)
        result["micro"] = micro(args)
    if args.part in ("e2e", "both"):
        print(f"(b) sharegpt-like, {args.num_requests} requests, KV memory {args.memory_fraction:.0%} of their need:",
              flush=True)
        result["e2e"] = e2e(args)

    if "micro" in result:
        print(f"\n{'block':>6}{'blocks':>8}{'swap out ms':>13}{'swap in ms':>12}{'recompute ms':>14}{'swap/recompute':>16}")
        for r in result["micro"]:
            print(f"{r['block_size']:>6}{r['blocks']:>8}{r['swap_out_ms']:>13.2f}{r['swap_in_ms']:>12.2f}"
                  f"{r['recompute_ms']:>14.2f}{r['swap_ms'] / r['recompute_ms']:>16.3f}")
    if "e2e" in result:
        print(f"\n{'block':>6} {'mode':<10}{'out tok/s':>10}{'latency s':>11}{'steps':>7}{'tokens run':>11}"
              f"{'preempt':>9}{'swapped':>9}{'recomputed':>12}{'same out':>10}")
        for r in result["e2e"]:
            print(f"{r['block_size']:>6} {r['mode']:<10}{r['output_tok_s']:>10.1f}{r['mean_latency_s']:>11.1f}"
                  f"{r['steps']:>7}{r['computed_tokens']:>11}{r['num_preemptions']:>9}"
                  f"{r['num_swapped_out_blocks']:>9}{r['num_recomputed_tokens']:>12}{r['identical_outputs']:>10}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
