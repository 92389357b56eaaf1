"""The tiled prefill attention kernel on a short chunk after a long cached prefix (a disk-tier or
prefix-cache hit's suffix, issue 53), at the 1.7B shape (32 query and 32 KV heads of 64).

    .venv/bin/python benchmarks/prefill_attention.py [--context 1152] [--chunk 40] [--seqs 2]

Times cpu.paged_attention alone (float32 KV in head-major blocks, as the CPU runner keeps them),
over --layers caches of distinct data so the blocks come from memory as in a real step, and prints
the time per 24-layer forward and the FLOP rate of its two products (Q K^T and P V). Also a
prefill of --context tokens from scratch (chunks of 512), which the same kernel serves.
JSON: benchmarks/results/prefill_attention.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.vs_vllm import cpu_flags, cpu_model  # noqa: E402
from pagedserve.kernels import cpu  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 32, 32, 64, 16, 24


def step_inputs(specs: list[tuple[int, int]], layers: int, gen: torch.Generator):
    """specs: (context before, new tokens) per sequence. Returns the per-layer caches (head-major),
    the queries and the kernel's rows."""
    tables, lens, starts, blocks = [], [], [0], 0
    for ctx, new in specs:
        n = -(-(ctx + new) // BLOCK)
        tables.append(list(range(blocks, blocks + n)))
        blocks += n
        lens.append(ctx + new)
        starts.append(starts[-1] + new)
    perm = torch.randperm(blocks, generator=gen)              # scattered blocks
    width = max(map(len, tables))
    table = torch.tensor([[int(perm[b]) for b in t] + [0] * (width - len(t)) for t in tables], dtype=torch.int64)
    caches = [torch.randn(2, blocks, KV_HEADS, BLOCK, HEAD_DIM, generator=gen).transpose(2, 3) for _ in range(layers)]
    q = torch.randn(starts[-1], HEADS, HEAD_DIM, generator=gen)
    rows = cpu.AttentionRows.of(table, torch.tensor(lens, dtype=torch.int64), torch.tensor(starts, dtype=torch.int64),
                                0, None)
    return caches, q, rows


def time_forward(specs: list[tuple[int, int]], layers: int, repeats: int) -> float:
    """Median seconds of one call per layer, scaled to LAYERS layers."""
    caches, q, rows = step_inputs(specs, layers, torch.Generator().manual_seed(0))
    scale = HEAD_DIM ** -0.5
    assert cpu.paged_attention(q, caches[0], rows, scale) is not None, "the tiled kernel did not run"
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for c in caches:
            cpu.paged_attention(q, c, rows, scale)
        times.append((time.perf_counter() - t0) * LAYERS / layers)
    return statistics.median(times)


def flops(specs: list[tuple[int, int]]) -> float:
    """Both products' FLOPs per forward (causal: query j of a chunk sees ctx + j + 1 keys)."""
    keys = sum(ctx * new + new * (new + 1) / 2 for ctx, new in specs)
    return 2 * 2 * keys * HEADS * HEAD_DIM * LAYERS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=1152)
    ap.add_argument("--chunk", type=int, default=40)
    ap.add_argument("--seqs", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4, help="distinct caches timed (scaled to 24 layers)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "prefill_attention.json"))
    args = ap.parse_args()
    cases = {
        f"{args.seqs} x {args.chunk} tokens after {args.context} cached": [(args.context, args.chunk)] * args.seqs,
        f"1 x {args.context} tokens from scratch (chunks of 512)":
            [(c, min(512, args.context - c)) for c in range(0, args.context, 512)],
    }
    rows = []
    print(f"threads {torch.get_num_threads()}, CPU {cpu_model()} ({' '.join(cpu_flags())}), "
          f"kernels {cpu.KERNELS.variant()}")
    for name, specs in cases.items():
        if "scratch" in name:     # each chunk is its own step, after the one before
            s = sum(time_forward([spec], args.layers, args.repeats) for spec in specs)
        else:
            s = time_forward(specs, args.layers, args.repeats)
        f = sum(flops([spec]) for spec in specs)
        rows.append(dict(case=name, seconds_per_forward=s, gflop_s=f / s / 1e9))
        print(f"{name:45} {1000 * s:8.1f} ms per 24-layer forward  {f / s / 1e9:6.1f} GFLOP/s")
    result = dict(args=vars(args), cpu_model=cpu_model(), cpu_flags=cpu_flags(), threads=torch.get_num_threads(),
                  variant=cpu.KERNELS.variant(), rows=rows)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
