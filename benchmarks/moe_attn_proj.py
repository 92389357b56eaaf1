"""The attention projections of an OLMoE Q4_K_M decode token, alone: 16 layers of fused q/k/v (q and k
Q4_K, v Q6_K: here in every layer, llama-quantize's Q4_K_M has it in 10 of the 16) and o (Q4_K), hidden 2048, all in
the r8 layouts (quant.repack), then the LM head (Q6_K, 49152 x 2048), at one activation row: what
quant_linear_small's r8 path streams per token besides the experts. With --ab-source, another build of
quant_kernels.cpp (e.g. main's) runs interleaved with this one: how the threads share the groups
shows here (parts whose types cost differently a byte).

    .venv/bin/python benchmarks/moe_attn_proj.py --rounds 20
    git worktree add /tmp/base main
    .venv/bin/python benchmarks/moe_attn_proj.py --ab-source /tmp/base/pagedserve/kernels/csrc/quant_kernels.cpp

Measure only through /work/bin/timed (or on an otherwise quiet machine).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.gemm_r8 import cpu_flags  # noqa: E402
from benchmarks.quant_kernels import other_build, random_weight  # noqa: E402
from pagedserve.kernels import quant  # noqa: E402

HIDDEN, LAYERS, VOCAB = 2048, 16, 49152


def token_weights(rng: np.random.Generator) -> tuple[list[list[quant.QuantizedWeight]], list[quant.QuantizedWeight]]:
    """Per layer the qkv parts and o; the LM head's one part (each in the layout the loader gives)."""
    def w(qtype: str, rows: int) -> quant.QuantizedWeight:
        return quant.repack(random_weight(qtype, rows, HIDDEN, rng))
    layers = [[w("q4_k", HIDDEN), w("q4_k", HIDDEN), w("q6_k", HIDDEN)] for _ in range(LAYERS)]
    return layers + [[w("q4_k", HIDDEN)] for _ in range(LAYERS)], [w("q6_k", VOCAB)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--ab-source", default=None, help="another quant_kernels.cpp to time interleaved with this one")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    projections, head = token_weights(rng)
    builds = {"this": quant.load()}
    if args.ab_source:
        builds["other"] = other_build(args.ab_source)
    x = torch.randn(1, HIDDEN)
    work = {"projections": projections, "lm_head": [head]}
    times = {(b, k): [] for b in builds for k in work}
    for r in range(args.rounds + 1):             # round 0: warm-up
        for b, lib in builds.items():
            for k, calls in work.items():
                start = time.perf_counter()
                for parts in calls:
                    quant._linear_small(x, parts, None, lib, torch.float32)
                if r:
                    times[(b, k)].append(time.perf_counter() - start)
    rows = []
    for (b, k), ts in times.items():
        nbytes = sum(p.nbytes for parts in work[k] for p in parts)
        med = statistics.median(ts)
        rows.append(dict(build=b, work=k, mb=nbytes / 1e6, min_ms=min(ts) * 1e3, median_ms=med * 1e3,
                         gb_s=nbytes / med / 1e9))
        print(f"{b:<6} {k:<12} {nbytes / 1e6:7.1f} MB  min {min(ts) * 1e3:7.3f} ms  median {med * 1e3:7.3f} ms  "
              f"{nbytes / med / 1e9:5.1f} GB/s", flush=True)
    if "other" in builds:
        for k in work:
            ratio = statistics.median(times[("other", k)]) / statistics.median(times[("this", k)])
            print(f"{k}: other / this (median) = {ratio:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(flags=cpu_flags(), variant=quant.variant(),
                                                   threads=torch.get_num_threads(), rows=rows), indent=1))


if __name__ == "__main__":
    main()
