"""The integer r8 kernels alone (csrc/quant/dot_r8_256.h, dot_k_r8_256.h, gemm_r8_256.h) on one
decoder layer of a shape (Qwen3-4B by default: qkv 6144x2560, o 2560x4096, gate_up 19456x2560,
down 2560x9728): per GGUF type, decode (T = 1, the dots) over --layers layers' distinct weights (so
they stream from memory) and prefill (T = --tokens, the GEMM) over one layer, each timing the minimum
over interleaved rounds in one process. With --ab-source, another build of quant_kernels.cpp (e.g.
main's, checked out elsewhere) runs interleaved with this one on the same weights and activations
(repeat it for several: each its own column).

    .venv/bin/python benchmarks/gemm_r8.py                       # ~1-2 min, 2 threads: q4_k, q6_k
    .venv/bin/python benchmarks/gemm_r8.py --types q4_k,q6_k,q5_0,q4_0 --ab-source /tmp/base/quant_kernels.cpp
    .venv/bin/python benchmarks/gemm_r8.py --tiny                # seconds: checks the script runs
    .venv/bin/python benchmarks/gemm_r8.py --shape smollm2-1.7b --types q4_0 --layers 24 --huge-pages  # engine-placed
    .venv/bin/python benchmarks/gemm_r8.py --shape smollm2-1.7b --types q4_0,q4_k --crossover 8,16,24,32,33,48,64

--crossover T,...: per type and T, one layer's products through the 1-4-row dots (the GEMM's rows
set past T) and through the GEMM, interleaved, and the ratio (where the dots win, kernels/quant.py's
R8_GEMM_MIN_ROWS should sit; both give the same bits per row).

Prints per type and T: ms per layer, weight GB/s, integer GOP/s (2 T N K per layer / time) and, with
--ab-source, this build's speedup over each other. Writes benchmarks/results/gemm_r8.json (--out)
with the CPU's flags and quant.describe().
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.quant_kernels import interleaved_min, other_build, random_weight  # noqa: E402
from pagedserve.kernels import quant  # noqa: E402
from pagedserve.kernels.quant import QuantizedWeight  # noqa: E402
from pagedserve.models import huge_pages  # noqa: E402

SHAPES = {"qwen3-4b": [(6144, 2560), (2560, 4096), (19456, 2560), (2560, 9728)],
          "smollm2-1.7b": [(6144, 2048), (2048, 2048), (16384, 2048), (2048, 8192)],
          "smollm2-135m": [(960, 576), (576, 576), (3072, 576), (576, 1536)],     # the default model
          "tiny": [(256, 256), (256, 512)]}


def cpu_flags() -> list[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return sorted(f for f in line.split(":", 1)[1].split()
                              if f.startswith(("avx", "fma", "f16c", "amx")))
    except OSError:
        pass
    return []


def measure(qtype: str, shapes: list, layers: int, tokens: int, rounds: int, others: list,
            huge: bool = False) -> list[dict]:
    rng = np.random.default_rng(0)
    weights = [quant.repack(random_weight(qtype, n, k, rng)) for _ in range(layers) for n, k in shapes]
    if huge:     # where the engine's loader puts them (models/huge_pages.py)
        weights = [QuantizedWeight(w.qtype, w.shape, huge_pages.copy_to_huge_pages(w.data)) for w in weights]
    if weights[0].qtype not in quant.R8:
        raise SystemExit(f"{qtype}: no r8 layout in variant {quant.variant()} (the r8 kernels need avx2 / avxvnni)")
    rows = []
    for t, ws in ((1, weights), (tokens, weights[:len(shapes)])):
        xs = {k: torch.randn(t, k).bfloat16() for _, k in shapes}
        libs = [quant.load()] + [lib for _, lib in others]
        fns = [lambda lib=lib: [quant._linear_small(xs[w.shape[1]], [w], None, lib) for w in ws] for lib in libs]
        times = interleaved_min(fns, rounds)
        nbytes, ops = sum(w.nbytes for w in ws), sum(2 * t * w.shape[0] * w.shape[1] for w in ws)
        n_layers = len(ws) // len(shapes)
        per_layer = times[0] / n_layers
        row = dict(type=qtype, layout=weights[0].qtype, variant=quant.variant(), tokens=t, layers=n_layers,
                   ms_per_layer=per_layer * 1e3, gbs=nbytes / times[0] / 1e9, gops=ops / times[0] / 1e9)
        ab = [dict(source=src, ms_per_layer=other / n_layers * 1e3, speedup=other / times[0])
              for (src, _), other in zip(others, times[1:])]
        if ab:       # (the first other build's keys as before; every one's in `ab`)
            row.update(ab_ms_per_layer=ab[0]["ms_per_layer"], ab_speedup=ab[0]["speedup"], ab=ab)
        rows.append(row)
        shown = "".join(f"  | --ab-source {o['ms_per_layer']:8.2f} ms (this build {o['speedup']:.3f}x)" for o in ab)
        print(f"{qtype:5} {row['layout']:7} T={t:<4} {row['ms_per_layer']:8.2f} ms/layer {row['gbs']:6.1f} GB/s "
              f"{row['gops']:7.1f} GOP/s{shown}", flush=True)
    return rows


def crossover(qtype: str, shapes: list, counts: list[int], rounds: int) -> list[dict]:
    """One layer's products at each T in counts: the dots (GEMM off) vs the GEMM, interleaved."""
    rng = np.random.default_rng(0)
    ws = [quant.repack(random_weight(qtype, n, k, rng)) for n, k in shapes]
    lib, rows = quant.load(), []
    for t in counts:
        xs = {k: torch.randn(t, k).bfloat16() for _, k in shapes}

        def run(min_rows: int) -> None:
            previous = quant.set_gemm_r8_min_rows(min_rows)
            try:
                for w in ws:
                    quant._linear_small(xs[w.shape[1]], [w], None, lib)
            finally:
                quant.set_gemm_r8_min_rows(previous)
        dots, gemm = interleaved_min([lambda: run(1 << 30), lambda: run(1)], rounds)
        rows.append(dict(type=qtype, layout=ws[0].qtype, tokens=t, dots_ms=dots * 1e3, gemm_ms=gemm * 1e3,
                         gemm_over_dots=gemm / dots))
        print(f"{qtype:5} T={t:<4} dots {dots * 1e3:8.2f} ms  gemm {gemm * 1e3:8.2f} ms  gemm/dots {gemm / dots:.3f}"
              f"  (per row: dots {dots * 1e3 / t:.3f}, gemm {gemm * 1e3 / t:.3f} ms)", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3-4b", choices=[s for s in SHAPES if s != "tiny"])
    ap.add_argument("--types", default="q4_k,q6_k")
    ap.add_argument("--tokens", type=int, default=128, help="activation rows of the prefill timing")
    ap.add_argument("--layers", type=int, default=2, help="layers of distinct weights for the decode timing")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ab-source", action="append", default=[],
                    help="another quant_kernels.cpp, built and run interleaved (repeat: each one)")
    ap.add_argument("--huge-pages", action="store_true",
                    help="the decode weights in 2 MiB pages, as the engine's loader places them")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes, 2 rounds: checks the script runs")
    ap.add_argument("--crossover", default=None, help="T,...: the dots vs the GEMM at these rows (one layer)")
    ap.add_argument("--out", default=None, help="default: benchmarks/results/gemm_r8.json "
                    "(gemm_r8_crossover.json with --crossover)")
    args = ap.parse_args()
    shapes = SHAPES["tiny" if args.tiny else args.shape]
    rounds = 2 if args.tiny else args.rounds
    quant.set_batch_invariant(True)        # every product on the integer path (what the GEMM serves)
    others = [(src, other_build(src)) for src in args.ab_source]
    print(f"variant {quant.variant()}, {torch.get_num_threads()} threads, flags {' '.join(cpu_flags())}", flush=True)
    if args.crossover:
        counts = [int(t) for t in args.crossover.split(",")]
        rows = [r for q in args.types.split(",") for r in crossover(q, shapes, counts, rounds)]
    else:
        rows = [r for q in args.types.split(",") for r in measure(q, shapes, args.layers, args.tokens, rounds, others,
                                                                   args.huge_pages)]
    name = "gemm_r8_crossover.json" if args.crossover else "gemm_r8.json"
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(command=" ".join(sys.argv), shape="tiny" if args.tiny else args.shape,
                                   threads=torch.get_num_threads(), cpu_flags=cpu_flags(), ab_source=args.ab_source,
                                   quant=quant.describe(), rows=rows), indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
