"""The read bandwidth that the decode benchmarks' "% of bound" divides by, on its own, with the CPU flags.

    .venv/bin/python benchmarks/read_bandwidth.py [--gib 1] [--repeats 5] [--json FILE]

`pagedserve.bench.throughput.read_bandwidth` (what benchmarks/decode_profile.py and
benchmarks/quantized.py call): a torch sum over a buffer much larger than the caches, the best of
`repeats` passes, here printed apart for 4 KiB pages and for the huge pages the loader puts quantized
weights in (where the kernel has them); the bound of a decode step is its weight bytes over the
larger of the two.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def best_read(x: torch.Tensor, repeats: int) -> float:
    """Bytes/s of the fastest of `repeats` sums over x (after one warm-up sum)."""
    x.sum()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return x.numel() * x.element_size() / best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0, help="buffer size in GiB")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from pagedserve.bench.throughput import read_bandwidth
    from pagedserve.kernels import cpu
    from pagedserve.models import huge_pages
    nbytes = int(args.gib * (1 << 30))
    plain = torch.ones(nbytes // 4, dtype=torch.float32)
    result = dict(threads=torch.get_num_threads(), nbytes=nbytes, repeats=args.repeats,
                  cpu_model=cpu.describe().get("cpu_model"), cpu_flags=sorted(cpu.cpu_flags()),
                  pages_4k_bytes_s=best_read(plain, args.repeats))
    if huge_pages.available():
        result["huge_pages_bytes_s"] = best_read(huge_pages.copy_to_huge_pages(plain), args.repeats)
    result["read_bandwidth_bytes_s"] = read_bandwidth(nbytes, args.repeats)   # the figure the benchmarks use
    simd = [f for f in result["cpu_flags"] if f.startswith(("avx", "amx", "fma", "f16c"))]
    print(f"{result['cpu_model']}, SIMD flags {' '.join(simd)} (all in the JSON), {result['threads']} threads")
    print(f"4 KiB pages: {result['pages_4k_bytes_s'] / 1e9:.1f} GB/s")
    if "huge_pages_bytes_s" in result:
        print(f"huge pages:  {result['huge_pages_bytes_s'] / 1e9:.1f} GB/s")
    print(f"read_bandwidth (the benchmarks' bound): {result['read_bandwidth_bytes_s'] / 1e9:.1f} GB/s")
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
