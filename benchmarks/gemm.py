"""Our GEMMs per number of rows M: the packed bf16 GEMM (kernels/cpu.py linear over pack_weight)
with AMX on and off, torch's bf16 matmul on the same operands, and the quantized linear
(kernels/quant.py, the path the engine takes: integer dots up to quant.batch_rows, dequantized
tiles over the GEMM above) per GGUF type, AMX on and off; and, per type, the integer path against
the tiles at the rows where one hands over to the other (quant.AMX_INT8_BATCH_ROWS, AMX_BATCH_ROWS,
SMALL_BATCH_ROWS, DECODE_BATCH_ROWS), the integer dots on vpdpbusd against AMX-INT8 (their
AMX_INT8_MIN_ROWS), and the bf16 GEMM's AMX threshold (cpu.AMX_MIN_ROWS) the same way.

    .venv/bin/python benchmarks/gemm.py --quick     # < 2 min quiet (2 threads): 1.7B shape, 4 types
    .venv/bin/python benchmarks/gemm.py             # ~6 min: both shapes, every type, more M
    .venv/bin/python benchmarks/gemm.py --tiny      # seconds: checks the script runs (measures nothing)

Shapes: one decoder layer's matrices (qkv, o, gate_up, down) of SmolLM2-135M (hidden 576, MLP
1536) and of SmolLM2-1.7B (hidden 2048, MLP 8192). Each timing is the minimum over alternations
of all the contenders of a row, interleaved in one process (so load on the machine shifts them
alike); GFLOP/s = 2 M (sum of N K over the layer) / time. Prints tables and writes
benchmarks/results/gemm.json (gemm_quick.json with --quick) with cpu.describe() and quant.describe().
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.quant_kernels import random_weight  # noqa: E402
from pagedserve.kernels import cpu, quant  # noqa: E402

SHAPES = {"135M": [(960, 576), (576, 576), (3072, 576), (576, 1536)],
          "1.7B": [(6144, 2048), (2048, 2048), (16384, 2048), (2048, 8192)]}


def interleaved(fns: dict, rounds: int, budget_s: float = 1.0) -> dict:
    """Seconds per call of each function: the minimum over `rounds` alternations of them all
    (each a few calls, about budget_s / rounds in all)."""
    for f in fns.values():
        f()
    t0 = time.perf_counter()
    next(iter(fns.values()))()
    calls = max(1, min(20, int(budget_s / rounds / max(time.perf_counter() - t0, 1e-6) / len(fns))))
    best = {k: float("inf") for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            start = time.perf_counter()
            for _ in range(calls):
                f()
            best[k] = min(best[k], (time.perf_counter() - start) / calls)
    return best


def with_amx(on: bool, fn, min_rows: int | None = None):
    """fn with the GEMM's AMX path on (from min_rows rows; None: as shipped) or off."""
    def run():
        with cpu.using_amx(on, min_rows):
            fn()
    return run


def with_amx_int8(on: bool, fn):
    """fn with the quantized dots on AMX-INT8 (from 1 row) or on vpdpbusd."""
    def run():
        with quant.using_amx_int8(on, 1):
            fn()
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="shapes / 8, few rows: checks the script runs")
    parser.add_argument("--shapes", default=None, help="135M,1.7B (default: 1.7B with --quick, else both)")
    parser.add_argument("--types", default=None, help="GGUF types (default: q4_0,q4_1,q8_0,q4_k with --quick)")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    shapes = (args.shapes or ("1.7B" if args.quick or args.tiny else "135M,1.7B")).split(",")
    types = (args.types or ("q4_0,q4_1,q8_0,q4_k" if args.quick or args.tiny else ",".join(quant.QTYPES))).split(",")
    rows = [1, 16, 64] if args.tiny else [1, 4, 16, 64, 128, 512] if args.quick else \
        [1, 2, 4, 8, 16, 32, 64, 128, 512]
    handover = [4, 12] if args.tiny else [2, 4, 8, 16, 32, 64, 96] if args.quick else \
        [2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128]
    amx_rows = [2, 4] if args.tiny else [2, 3, 4, 6, 8]
    rounds = args.rounds or (2 if args.tiny else 3 if args.quick else 7)
    amx = cpu.set_amx(None)
    amx8 = quant.amx_int8_in_use()
    print(f"CPU kernels: {cpu.variant()}; {cpu.describe_amx()}; quant kernels: {quant.variant()}; "
          f"threads {torch.get_num_threads()}")
    rng = np.random.default_rng(0)
    gemm, quantized, handovers, thresholds = [], [], [], []
    for shape in shapes:
        dims = [(n // 8, k // 8) for n, k in SHAPES[shape]] if args.tiny else SHAPES[shape]
        flops_per_row = 2 * sum(n * k for n, k in dims)
        weights = [torch.randn(n, k).bfloat16() / k ** 0.5 for n, k in dims]
        packed = [cpu.pack_weight(w) for w in weights]
        print(f"\n{shape} layer {dims}: bf16 GEMM GFLOP/s")
        print(f"{'M':>5} {'ours AMX':>9} {'ours off':>9} {'torch':>9}")
        for m in rows:
            xs = {k: torch.randn(m, k).bfloat16() for _, k in dims}
            ours = lambda: [cpu.linear(xs[p.in_features], p) for p in packed]    # noqa: E731
            fns = {"ours_off": with_amx(False, ours),
                   "torch": lambda: [xs[w.shape[1]] @ w.t() for w in weights]}
            if amx:
                fns["ours_amx"] = with_amx(True, ours)
            t = interleaved(fns, rounds)
            row = dict(shape=shape, rows=m, **{f"{k}_gflops": m * flops_per_row / v / 1e9 for k, v in t.items()})
            gemm.append(row)
            print(f"{m:5} {row.get('ours_amx_gflops', 0):9.0f} {row['ours_off_gflops']:9.0f} {row['torch_gflops']:9.0f}")
        if amx:     # the bf16 GEMM's AMX threshold
            for m in amx_rows:
                xs = {k: torch.randn(m, k).bfloat16() for _, k in dims}
                ours = lambda: [cpu.linear(xs[p.in_features], p) for p in packed]    # noqa: E731
                t = interleaved({"amx": with_amx(True, ours, 1), "off": with_amx(False, ours)}, rounds)
                thresholds.append(dict(shape=shape, rows=m, amx_ms=t["amx"] * 1e3, vdpbf16ps_ms=t["off"] * 1e3))
            print("AMX threshold (ms per layer, AMX from 1 row vs off): " +
                  ", ".join(f"M={r['rows']} {r['amx_ms']:.2f}/{r['vdpbf16ps_ms']:.2f}" for r in thresholds
                            if r["shape"] == shape) + f" (shipped: from {cpu.AMX_MIN_ROWS})")
        del weights, packed

        print(f"\n{shape} quantized linear (the engine's path), GFLOP/s; bf16 x")
        print(f"{'type':6} {'M':>5} {'AMX':>9} {'off':>9}")
        for qtype in types:
            qw = [random_weight(qtype, n, k, rng) for n, k in dims]
            for m in rows:
                xs = {k: torch.randn(m, k).bfloat16() for _, k in dims}
                run = lambda: [quant.linear(xs[w.shape[1]], w) for w in qw]    # noqa: E731
                fns = {"off": with_amx(False, run)}
                if amx:
                    fns["amx"] = with_amx(True, run)
                t = interleaved(fns, rounds)
                row = dict(shape=shape, type=qtype, rows=m, **{f"{k}_gflops": m * flops_per_row / v / 1e9
                                                               for k, v in t.items()})
                quantized.append(row)
                print(f"{qtype:6} {m:5} {row.get('amx_gflops', 0):9.0f} {row['off_gflops']:9.0f}")
            lib = quant.load()
            line = []
            for m in handover:      # integer dots vs tiles (over AMX where on) at the same rows
                xs = {k: torch.randn(m, k).bfloat16() for _, k in dims}
                small = lambda: [quant._linear_small(xs[w.shape[1]], [w], None, lib) for w in qw]   # noqa: E731
                fns = {"integer": with_amx_int8(False, small),
                       "tiles": lambda: [quant._linear_tiles(xs[w.shape[1]], [w], None, lib) for w in qw]}
                if amx8:
                    fns["amx_int8"] = with_amx_int8(True, small)
                t = interleaved(fns, rounds)
                handovers.append(dict(shape=shape, type=qtype, rows=m, amx=amx, integer_ms=t["integer"] * 1e3,
                                      tiles_ms=t["tiles"] * 1e3, amx_int8_ms=t.get("amx_int8", 0) * 1e3))
                line.append(f"M={m} {t['integer'] * 1e3:.2f}/{t.get('amx_int8', 0) * 1e3:.2f}/{t['tiles'] * 1e3:.2f}")
            shipped = (f"then weights as AMX A tiles to {quant.amxw_rows()[1]} rows" if quant.amxw_in_use() else
                       f"on AMX-INT8 from {quant.amx_int8_min_rows()}")
            print(f"{qtype:6} vpdpbusd/AMX-INT8/tiles ms: {', '.join(line)} (shipped: integer up to "
                  f"{quant.batch_rows(bf16=True)}, {shipped})")
            del qw

    name = "gemm_quick.json" if args.quick else "gemm.json"
    if args.tiny and not args.out:      # measures nothing: no results file
        return
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(cpu=cpu.describe(), quant=quant.describe(), threads=torch.get_num_threads(),
                                   rounds=rounds, gemm=gemm, amx_threshold=thresholds, quantized=quantized,
                                   handover=handovers), indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
