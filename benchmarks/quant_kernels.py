"""Linear layers over GGUF block formats (kernels/quant.py) against the bf16 packed GEMM of
kernels/cpu.py, at a SmolLM2-1.7B-shaped layer (hidden 2048, MLP 8192: qkv 6144x2048, o
2048x2048, gate_up 16384x2048, down 2048x8192), over several layers' worth of distinct weights
so they stream from memory as in a real step.

    .venv/bin/python benchmarks/quant_kernels.py --quick     # ~1-2 min: 2 layers, T 1-128, the active variant
    .venv/bin/python benchmarks/quant_kernels.py --tiny      # seconds: shapes / 8 (checks the script runs)
    .venv/bin/python benchmarks/quant_kernels.py             # ~10 min: 4 layers, more T, every variant

Per type and T: ms per pass over the layers, weight GB/s (bytes of the quantized weights read
per pass / time: the decode bound is the machine's read bandwidth, measured first) and GFLOP/s; the bf16 row is
the same shapes through cpu.linear over packed bf16 weights; rows with a `path` time the integer
path against the dequantized tiles at the same T (where SMALL_BATCH_ROWS and DECODE_BATCH_ROWS should
be). Prints a table and writes
benchmarks/results/quant_kernels.json with quant.describe() and cpu.describe().
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.cpu_kernels import median_seconds  # noqa: E402
from pagedserve.kernels import cpu, quant  # noqa: E402

SHAPES = [(6144, 2048), (2048, 2048), (16384, 2048), (2048, 8192)]


def random_weight(qtype: str, rows: int, cols: int, rng: np.random.Generator) -> quant.QuantizedWeight:
    """Random quants with small fp16 scales in every scale field (values do not matter here)."""
    nb, bb = cols // quant.BLOCK[qtype], quant.BLOCK_BYTES[qtype]
    blocks = rng.integers(0, 256, size=(rows, nb, bb), dtype=np.uint8)
    scale = np.full((rows, nb, 1), 0.002, dtype=np.float16).view(np.uint8)
    for offset in {"q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,), "q4_1": (0, 2), "q5_1": (0, 2)}.get(qtype, (0,)):
        blocks[..., offset:offset + 2] = scale
    return quant.from_gguf_blocks(qtype, torch.from_numpy(blocks.reshape(rows, nb * bb)), (rows, cols))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--tiny", action="store_true", help="shapes / 8, one layer: checks the script runs")
    parser.add_argument("--types", default=",".join(quant.QTYPES))
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "quant_kernels.json"))
    args = parser.parse_args()
    global SHAPES
    if args.tiny:
        SHAPES = [(n // 8, k // 8) for n, k in SHAPES]
    layers = args.layers or (1 if args.tiny else 2 if args.quick else 4)
    tokens = [1, 20] if args.tiny else [1, 4, 16, 128] if args.quick else [1, 2, 4, 8, 16, 32, 128, 512]
    crossover = [12, 20] if args.tiny else [8, 16, 32] if args.quick else [8, 16, 24, 32, 48, 64]
    variants = [quant.variant()] if args.quick or args.tiny else quant.supported_variants()
    repeats = 3 if args.quick else 5
    rng = np.random.default_rng(0)
    params = layers * sum(n * k for n, k in SHAPES)
    results = []

    # The machine's read bandwidth (torch's threaded sum over 256 MiB): the bound decode should reach.
    probe = torch.ones((16 if args.tiny else 256) << 18, dtype=torch.float32)
    sec = median_seconds(lambda: probe.sum(), repeats)
    read_gbs = probe.numel() * 4 / sec / 1e9
    print(f"read bandwidth (torch sum): {read_gbs:.1f} GB/s")
    del probe

    bf16 = [cpu.pack_weight(torch.randn(n, k).bfloat16()) for _ in range(layers) for n, k in SHAPES]
    for t in tokens:
        xs = {k: torch.randn(t, k).bfloat16() for _, k in SHAPES}
        sec = median_seconds(lambda: [cpu.linear(xs[w.in_features], w) for w in bf16], repeats)
        results.append(dict(type="bf16 packed", variant=cpu.variant(), tokens=t, ms=1e3 * sec,
                            weight_gbs=2 * params / sec / 1e9, gflops=2 * t * params / sec / 1e9))
        print(f"{'bf16 packed':12} {cpu.variant():11} T={t:4} {1e3 * sec:9.2f} ms {2 * params / sec / 1e9:7.1f} GB/s")
    del bf16

    for qtype in args.types.split(","):
        weights = [random_weight(qtype, n, k, rng) for _ in range(layers) for n, k in SHAPES]
        nbytes = sum(w.nbytes for w in weights)
        for name in variants:
            with quant.using_variant(name):
                for t in tokens:
                    xs = {k: torch.randn(t, k).bfloat16() for _, k in SHAPES}
                    sec = median_seconds(lambda: [quant.linear(xs[w.shape[1]], w) for w in weights], repeats)
                    results.append(dict(type=qtype, variant=name, tokens=t, ms=1e3 * sec,
                                        weight_gbs=nbytes / sec / 1e9, gflops=2 * t * params / sec / 1e9))
                    print(f"{qtype:12} {name:11} T={t:4} {1e3 * sec:9.2f} ms {nbytes / sec / 1e9:7.1f} GB/s "
                          f"{2 * t * params / sec / 1e9:7.1f} GFLOP/s")
                # Where the integer path should hand over to the tiles (quant.SMALL_BATCH_ROWS).
                for t in crossover:
                    xs = {k: torch.randn(t, k).bfloat16() for _, k in SHAPES}
                    lib = quant.load()
                    for path, fn in (("integer", quant._linear_small), ("tiles", quant._linear_tiles)):
                        sec = median_seconds(lambda: [fn(xs[w.shape[1]], [w], None, lib) for w in weights], repeats)
                        results.append(dict(type=qtype, variant=name, tokens=t, path=path, ms=1e3 * sec,
                                            weight_gbs=nbytes / sec / 1e9, gflops=2 * t * params / sec / 1e9))
                        print(f"{qtype:12} {name:11} T={t:4} {path:8} {1e3 * sec:9.2f} ms")
        del weights

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(quant=quant.describe(), cpu=cpu.describe(), layers=layers, read_gbs=read_gbs,
                                   threads=torch.get_num_threads(), results=results), indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
