"""The r8 decode dots (T = 1) streaming distinct weights from memory, per thread count, this build's
kernels against other builds of quant_kernels.cpp (e.g. main's, or a changed prefetch schedule)
interleaved in one process: the memory side of the dots (issues 49, 50).

    .venv/bin/python benchmarks/r8_stream.py --ab-source /tmp/base/quant_kernels.cpp \
        --ab-source /tmp/other/quant_kernels.cpp --threads 1,2 --types q4_0,q8_0,q4_k,q6_k

Per type: --layers layers of SmolLM2-1.7B-shaped matrices (benchmarks/quant_kernels.py's SHAPES; --shape
135m: the default model's small ones), in the r8 layouts the loader gives, one after another in 2 MiB
pages as the engine places them (~66-140 MB: over the 32 MB L3), one T = 1 pass (--tokens: 1-4 rows) over all of them
through `quant._linear_small` per build, a plain read of the same bytes (torch's float sum) and each
build's kernel over a weight kept in L2 (~1 MiB a thread, called 20 times: its compute-bound rate),
all in turn --rounds times, the minimum of each kept. Per thread count (torch.set_num_threads: the
kernels' OpenMP team is the same libgomp's). Prints ns per 8-row unit (a 32-element block of 8
rows, or a 256-element super-block for the K-quants) and GB/s, each build's stream also as a ratio
to this build's; writes --out (JSON) with the CPU's flags and quant.describe().
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.quant_kernels import SHAPES, interleaved_min, other_build, random_weight  # noqa: E402
from pagedserve.kernels import cpu, quant  # noqa: E402
from pagedserve.models import huge_pages  # noqa: E402


def unit_bytes(qtype: str) -> int:
    """Bytes of one 8-row unit of the type's r8 layout (8 file blocks)."""
    return 8 * quant.BLOCK_BYTES[qtype]


# The default model's (SmolLM2-135M: hidden 576, MLP 1536, 9 heads and 3 KV heads of 64): small products
SHAPES_135M = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def measure(qtype: str, builds: dict, shapes: list, layers: int, rounds: int, threads: list[int], tokens: int,
            rng) -> list[dict]:
    """Per thread count: each build's stream and in-L2 time a unit, and the plain read's."""
    weights = [quant.repack(random_weight(qtype, n, k, rng)) for _ in range(layers) for n, k in shapes]
    # one after another in 2 MiB pages, as the engine's loader places them (models/huge_pages.py)
    weights = [quant.QuantizedWeight(w.qtype, w.shape, huge_pages.copy_to_huge_pages(w.data)) for w in weights]
    nbytes = sum(w.nbytes for w in weights)
    plain = [w.data.view(-1)[: w.data.numel() // 4 * 4].view(torch.float32) for w in weights]
    units = nbytes / unit_bytes(qtype)
    rows = []
    for nt in threads:
        torch.set_num_threads(nt)
        k0 = shapes[0][1]
        cached_rows = max(8, (1 << 20) * nt // (k0 // quant.BLOCK[qtype] * quant.BLOCK_BYTES[qtype]) // 8 * 8)
        cached = quant.repack(random_weight(qtype, cached_rows, k0, rng))
        assert cached.qtype == weights[0].qtype, (cached.qtype, weights[0].qtype)
        xs = {k: torch.randn(tokens, k).bfloat16() for _, k in shapes}
        fns = [lambda: [p.sum() for p in plain]]
        for lib in builds.values():
            fns += [lambda lib=lib: [quant._linear_small(xs[w.shape[1]], [w], None, lib) for w in weights],
                    lambda lib=lib: [quant._linear_small(xs[k0], [cached], None, lib) for _ in range(20)]]
        best = interleaved_min(fns, rounds)
        cached_units = 20 * cached.nbytes / unit_bytes(qtype)
        row = dict(type=qtype, r8=weights[0].qtype, threads=nt, tokens=tokens, mb=nbytes / 1e6,
                   read_gbs=nbytes / best[0] / 1e9)
        for i, name in enumerate(builds):
            s, c = best[1 + 2 * i], best[2 + 2 * i]
            row[name] = dict(stream_ns_unit=s / units * 1e9, stream_gbs=nbytes / s / 1e9,
                             l2_ns_unit=c / cached_units * 1e9, l2_gbs=cached.nbytes * 20 / c / 1e9)
        base = row[next(iter(builds))]["stream_ns_unit"]
        print(f"{qtype:5} {weights[0].qtype:7} {nt} thr  read {row['read_gbs']:5.1f} GB/s  " + "  ".join(
            f"{name}: {row[name]['stream_ns_unit']:6.1f} ns ({row[name]['stream_gbs']:4.1f} GB/s, "
            f"{base / row[name]['stream_ns_unit']:.3f}x) L2 {row[name]['l2_ns_unit']:5.1f}" for name in builds),
            flush=True)
        rows.append(row)
    return rows


def ab_label(src: str, sources: list[str]) -> str:
    """An --ab-source's label: the folder of the checkout it is in (TREE of
    TREE/pagedserve/kernels/csrc/quant_kernels.cpp), else its own folder; its whole path where two
    sources would share a label (each build needs its own column)."""
    def short(path: str) -> str:
        p = Path(path).resolve()
        return p.parents[3].name if p.parent.parts[-3:] == ("pagedserve", "kernels", "csrc") else p.parent.name
    return short(src) if [short(s) for s in sources].count(short(src)) == 1 else str(Path(src).resolve())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--types", default="q4_0,q8_0,q4_k,q6_k")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--tokens", type=int, default=1, help="activation rows (1-4: a decode batch on the same dots)")
    ap.add_argument("--shape", default="1.7b", choices=["1.7b", "135m"],
                    help="SmolLM2-1.7B's products, or the default model's (135M: small matrices)")
    ap.add_argument("--layers", type=int, default=None, help="default: 2 (1.7b), 30 (135m)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--ab-source", action="append", default=[],
                    help="another quant_kernels.cpp (repeatable); labelled by its checkout's folder (ab_label)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "r8_stream.json"))
    args = ap.parse_args()
    builds = {"this": quant.load()}
    for src in args.ab_source:
        builds[ab_label(src, args.ab_source)] = other_build(src)
    rng = np.random.default_rng(0)
    threads = [int(n) for n in args.threads.split(",")]
    shapes, layers = (SHAPES, args.layers or 2) if args.shape == "1.7b" else (SHAPES_135M, args.layers or 30)
    rows = [r for qtype in args.types.split(",")
            for r in measure(qtype, builds, shapes, layers, args.rounds, threads, args.tokens, rng)]
    described = cpu.describe()
    Path(args.out).write_text(json.dumps(dict(
        cpu_model=described.get("cpu_model"), cpu_flags=described.get("cpu_flags"), quant=quant.describe(),
        ab_sources=args.ab_source, shape=args.shape, layers=layers, tokens=args.tokens, rows=rows), indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
