"""The routed experts' kernel alone (csrc/moe/experts.h, quant_moe_experts) on OLMoE-1B-7B's expert
shape (64 experts of gate/up 1024x2048 and down 2048x1024, 8 per token): decode (T = 1, a fresh
random choice of 8 experts per call over --layers layers' distinct experts, so their weights
stream from memory) and prefill (T = --tokens, each token's 8 experts random: ~T / 8 tokens an
expert), per mix (q4_0: all Q4_0; q4_k_m: gate and up Q4_K, down Q6_K, as llama-quantize's Q4_K_M
writes OLMoE's experts), the minimum over interleaved rounds in one process. Decode's GB/s counts
the chosen experts' bytes once per call, beside a plain read at the same thread count (read_gbs:
pagedserve.bench.throughput.read_bandwidth, torch's sum): with --threads 1,2 the two show whether the
kernel is bound by the stream or by a core's compute. With --ab-source, another build of
quant_kernels.cpp (e.g. main's) runs interleaved with this one on the same weights, activations and routes.

    .venv/bin/python benchmarks/moe_experts.py                    # ~1 min, 2 threads
    .venv/bin/python benchmarks/moe_experts.py --ab-source /tmp/base/quant_kernels.cpp
    .venv/bin/python benchmarks/moe_experts.py --threads 1,2 --mixes q4_k_m    # per-core rate vs the stream
    .venv/bin/python benchmarks/moe_experts.py --tiny             # seconds: checks the script runs

Writes benchmarks/results/moe_experts.json (--out) with the CPU's flags and quant.describe().
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.gemm_r8 import cpu_flags  # noqa: E402
from benchmarks.quant_kernels import interleaved_min, other_build, random_weight  # noqa: E402
from pagedserve.bench.throughput import read_bandwidth  # noqa: E402
from pagedserve.kernels import moe as moe_kernels  # noqa: E402
from pagedserve.kernels import quant  # noqa: E402
from pagedserve.models.moe import ExpertWeights  # noqa: E402

MIXES = {"q4_0": ("q4_0", "q4_0"), "q4_k_m": ("q4_k", "q6_k")}       # (gate and up, down)


def layer(mix: str, experts: int, hidden: int, width: int, rng) -> moe_kernels.ExpertTable:
    gu, down = MIXES[mix]
    return moe_kernels.expert_table([
        ExpertWeights((_pack(random_weight(gu, width, hidden, rng)), _pack(random_weight(gu, width, hidden, rng))),
                      _pack(random_weight(down, hidden, width, rng))) for _ in range(experts)])


def _pack(w: quant.QuantizedWeight) -> quant.QuantizedWeight:
    return quant.repack(w, experts=True)       # the loader's layout for experts (r8 on EXPERT_R8_VARIANTS)


def routes(tokens: int, experts: int, k: int, calls: int, rng) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for _ in range(calls):
        ids = np.stack([rng.choice(experts, k, replace=False) for _ in range(tokens)])
        out.append((torch.full((tokens, k), 1.0 / k), torch.from_numpy(ids)))
    return out


def measure(mix: str, args, other) -> list[dict]:
    rng = np.random.default_rng(0)
    tables = [layer(mix, args.experts, args.hidden, args.width, rng) for _ in range(args.layers)]
    expert_bytes = sum(p.nbytes for p in (*tables[0].experts[0].gate_up, tables[0].experts[0].down))
    libs = [quant.load()] + ([other] if other is not None else [])
    rows = []
    for t in (1, args.tokens):
        calls = 8 * args.layers if t == 1 else 1
        xs = torch.randn(t, args.hidden).bfloat16()
        rs = routes(t, args.experts, args.k, calls, rng)
        fns = [lambda lib=lib: [moe_kernels.routed_experts(xs, tables[i % len(tables)], w, ids, lib=lib)
                                for i, (w, ids) in enumerate(rs)] for lib in libs]
        ref = [moe_kernels.routed_experts(xs, tables[0], *rs[0], lib=lib) for lib in libs]
        times = interleaved_min(fns, args.rounds)
        per_call = [x / calls for x in times]
        row = dict(mix=mix, layout=tables[0].experts[0].down.qtype, variant=quant.variant(), tokens=t,
                   ms_per_layer=per_call[0] * 1e3, threads=torch.get_num_threads())
        if t == 1:
            row["gbs"] = args.k * expert_bytes / per_call[0] / 1e9
            row["read_gbs"] = read_bandwidth(1 << 28 if args.tiny else 1 << 30, 3) / 1e9
        else:
            row["gops"] = 2 * 3 * t * args.k * args.hidden * args.width / per_call[0] / 1e9
        if other is not None:
            row.update(other_ms=per_call[1] * 1e3, speedup=per_call[1] / per_call[0], same_output=bool(torch.equal(*ref)))
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mixes", default="q4_0,q4_k_m")
    ap.add_argument("--layers", type=int, default=4, help="layers of distinct experts decode cycles over")
    ap.add_argument("--tokens", type=int, default=256, help="prefill tokens")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ab-source", default=None, help="another quant_kernels.cpp to time interleaved with this one")
    ap.add_argument("--threads", default=None, help="thread counts to run in turn, e.g. 1,2 (default: torch's)")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "moe_experts.json"))
    args = ap.parse_args()
    args.experts, args.k, args.hidden, args.width = (8, 2, 256, 256) if args.tiny else (64, 8, 2048, 1024)
    if args.tiny:
        args.layers, args.tokens, args.rounds = 1, 16, 1
    if quant.variant() not in quant.EXPERT_R8_VARIANTS:
        raise SystemExit(f"variant {quant.variant()}: the experts' r8 layouts need avx512vnni / avx2 / avxvnni")
    other = other_build(args.ab_source) if args.ab_source else None
    rows = []
    for threads in [int(n) for n in args.threads.split(",")] if args.threads else [torch.get_num_threads()]:
        torch.set_num_threads(threads)          # (the kernels' OpenMP team: the same libgomp)
        rows += [r for mix in args.mixes.split(",") for r in measure(mix, args, other)]
    result = dict(flags=cpu_flags(), quant=quant.describe(), threads=torch.get_num_threads(), rows=rows)
    if not args.tiny:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
