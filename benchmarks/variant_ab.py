"""Single-stream decode of the same GGUF files on two or more quant kernel variants, interleaved
(and, with --llama-bench, llama.cpp's decode on the same files in the same rotation).

    /work/bin/timed .venv/bin/python benchmarks/variant_ab.py --variants vnni256,avx512vnni --pairs 2 \
        --files default /work/peers/files/smollm2-1.7b-shape-Q4_K_M-llama.gguf \
        --json benchmarks/results/variant_ab.json

Each file runs in child processes (benchmarks/quantized.py's child: load, a warm-up, then rounds of a
128-token prompt and --decode-len decode steps, each round's median step), one per variant
($PAGEDSERVE_QUANT_KERNELS), the variants in turn, --pairs times: on a host whose read bandwidth moves
from minute to minute, runs a few seconds apart compare the variants where runs minutes apart do not.
Each child reports the variant it ran (quant.describe()), so a label cannot name a variant that did not
run. `default`: the default model; a 1.7B- or Gemma-shaped file takes its tokenizer from the folder of
its shape beside it (benchmarks/quantized.py --work-dir).

With `--llama-bench EXE`, llama.cpp's `llama-bench -p 0 -n <decode-len> -d 128 -r <rounds>` on the same file
(decoding after 128 tokens of context, as our rounds do) takes a turn after the variants in every
pair, and each variant's median is also given as a ratio to llama.cpp's: a ratio of runs seconds
apart, where quantized.py's single run compares minutes apart.

Every turn is followed by a read probe (pagedserve.bench.throughput.read_bandwidth, 512 MiB, best of 3: each
of our rounds gets its own, quantized.py's paired_probe; llama-bench's turn one after its rounds), and each
round is also given as its share of the bound that probe sets (the file's weights read once a token,
pagedserve's count of them): on a host whose bandwidth switches between two modes, a ratio near 1.0 with
both engines near the bound says the memory, not the kernels, set both.

    /work/bin/timed .venv/bin/python benchmarks/variant_ab.py --variants vnni256 --pairs 3 \
        --llama-bench LB/llama-bench --files /work/peers/files/smollm2-1.7b-shape-Q4_0-llama.gguf

A variant written `VARIANT@TREE` runs from another checkout (TREE's benchmarks/quantized.py, so its
pagedserve and kernel sources): two builds of the same variant, e.g. main's and a branch's, compared
the same way (`git archive main pagedserve benchmarks | tar -x -C /tmp/main_tree`):

    /work/bin/timed .venv/bin/python benchmarks/variant_ab.py --variants vnni256@/tmp/main_tree,vnni256 \
        --pairs 3 --files /work/peers/files/smollm2-1.7b-shape-Q4_K_M-llama.gguf
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.quantized import child, llama_bench  # noqa: E402

LLAMA = "llama.cpp"


def tokenizer_dir(model: str) -> str | None:
    """The shape folder quantized.py writes beside its files (`<stem>-<mix>[-llama].gguf` -> `<stem>/`)."""
    path = Path(model)
    return str(path.parent / (path.name.split("-shape-")[0] + "-shape")) if "-shape-" in path.name else None


def run_child(model: str, variant: str, rounds: int, decode_len: int) -> dict:
    """One child of benchmarks/quantized.py on `variant` (`VARIANT@TREE`: from checkout TREE): its
    decode rounds and the variant it ran."""
    spec = dict(model=model, tokenizer=tokenizer_dir(model), prefill_len=128, repeats=0, decode_rounds=rounds,
                decode_len=decode_len, paired_probe=True)
    name, _, tree = variant.partition("@")
    result = child(spec, 600, env={"PAGEDSERVE_QUANT_KERNELS": name}, tree=tree or None)
    if "error" in result:
        raise RuntimeError(f"{variant} on {model}: {result['error']}")
    return result


def summary(rounds_ms: list[float], of_bound: list[float]) -> dict:
    """Decode tok/s of a variant's rounds (ms a step): their median and best; the median round's share
    of its paired bound."""
    ordered, shares = sorted(rounds_ms), sorted(of_bound)
    return dict(median_tok_s=1e3 / ordered[len(ordered) // 2], best_tok_s=1e3 / ordered[0], rounds=len(ordered),
                median_of_bound=shares[len(shares) // 2] if shares else None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="vnni256,avx512vnni", help="quant variants, comma-separated")
    ap.add_argument("--files", nargs="+", default=["default"], help="GGUF files (`default`: the default model)")
    ap.add_argument("--pairs", type=int, default=2, help="turns of every variant per file")
    ap.add_argument("--rounds", type=int, default=3, help="decode rounds per child")
    ap.add_argument("--decode-len", type=int, default=64)
    ap.add_argument("--llama-bench", default=None, help="llama.cpp's llama-bench: a turn of its own in every pair")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import torch
    from pagedserve.bench.throughput import read_bandwidth
    from pagedserve.kernels import cpu
    from pagedserve.models.loader import default_model_path
    variants = args.variants.split(",")
    turns = variants + ([LLAMA] if args.llama_bench else [])
    results = []
    for name in args.files:
        model = default_model_path() if name == "default" else name
        runs: dict[str, list[float]] = {v: [] for v in turns}
        of_bound: dict[str, list[float]] = {v: [] for v in turns}     # each round's share of its paired bound
        per_token = None                  # the file's weight bytes a token (our children's count)
        for _ in range(args.pairs):
            for v in turns:
                if v == LLAMA:
                    r = llama_bench(args.llama_bench, model, torch.get_num_threads(), 0, args.decode_len,
                                    repetitions=args.rounds)
                    if "error" in r:
                        raise RuntimeError(f"llama-bench on {model}: {r['error']}")
                    round_ms = [1e3 / ts for ts in r["decode_rounds_tok_s"]]
                    probes = [read_bandwidth(1 << 29, repeats=3)] * len(round_ms)
                else:
                    r = run_child(model, v, args.rounds, args.decode_len)
                    ran = r["quant_kernels"]
                    if ran != v.partition("@")[0]:
                        raise RuntimeError(f"asked for {v}, the child ran {ran}")
                    round_ms, probes, per_token = r["decode_round_ms"], r["decode_round_read_bytes_s"], r["bytes_per_token"]
                runs[v] += round_ms
                shares = [per_token / (m / 1e3) / bw for m, bw in zip(round_ms, probes)] if per_token else []
                of_bound[v] += shares
                print(f"{Path(model).name:44} {v:11} " + " ".join(f"{1e3 / m:7.1f}" for m in round_ms) + " tok/s"
                      + ("  of the bound " + " ".join(f"{f:4.0%}" for f in shares) + f" (probe {probes[-1] / 1e9:.1f} GB/s)"
                         if shares else ""), flush=True)
        row = dict(file=Path(model).name, runs_ms=runs, of_bound=of_bound,
                   **{v: summary(runs[v], of_bound[v]) for v in turns})
        base = LLAMA if args.llama_bench else variants[0]
        for v in variants:
            row[v]["ratio_to_" + base] = row[v]["median_tok_s"] / row[base]["median_tok_s"]
        results.append(row)
        print(f"  medians (ratio to {base}; of the bound): " + ", ".join(
            f"{v} {row[v]['median_tok_s']:.1f} ({row[v]['median_tok_s'] / row[base]['median_tok_s']:.2f}x; "
            f"{row[v]['median_of_bound'] or 0:.0%})" for v in turns), flush=True)
    if args.json:
        described = cpu.describe()
        Path(args.json).write_text(json.dumps(dict(variants=variants, llama_bench=args.llama_bench, pairs=args.pairs, threads=torch.get_num_threads(),
                                                   cpu_model=described.get("cpu_model"),
                                                   cpu_flags=described.get("cpu_flags"), results=results), indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
