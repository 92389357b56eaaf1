"""Decode attention alone: one sequence's query against its paged KV cache, per layer, on the CPU kernel.

    .venv/bin/python benchmarks/decode_attention.py [--lengths 16 160 330 1000] [--cold] [--json FILE]
        [--ab-library OTHER.so] [--pages]

For each model shape (the default model's 9 query / 3 KV heads of 64; Gemma 3 1B's 4 / 1 of 256)
and context length: 30 layers' float32 caches (head-major, scattered blocks of 16), one decode row
each, through the kernel's ctypes entry with its arguments built once (so Python costs ~1 us of a
call); the median and best microseconds a layer over 40 passes. --cold streams 96 MB between passes
(the layer loop's weights evict the KV from the caches), else the 30 layers' KV stays in L3.
Threads: OMP_NUM_THREADS (default: the CPUs this process may use). --ab-library: another compiled
cpu_kernels library (e.g. main's, from ~/.cache/pagedserve/kernels) timed in the same process, its
passes alternating with this tree's, so a small change shows through a noisy host.
--pages: the KV as the engine holds it instead (one bf16 cache of all 30 layers, 2048 blocks, the
sequence's scattered over them), in 4 KiB pages (torch.zeros) against huge pages (models/huge_pages.py
`zeros`, the model runner's), passes alternating.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {"smollm2-135m": (9, 3, 64), "gemma3-1b": (4, 1, 256)}


def layer_args(q: torch.Tensor, cache: torch.Tensor, rows, out: torch.Tensor, kv_heads: int, block: int) -> tuple:
    """One layer's arguments of the paged_attention kernel: q [1, heads, D], cache [2, blocks, block,
    kv_heads, D] (any strides but the last), rows (cpu.AttentionRows), out like q."""
    from pagedserve.kernels import cpu
    heads, head_dim = q.shape[1], q.shape[2]
    return (q.data_ptr(), q.stride(0), cache[0].data_ptr(), cache[1].data_ptr(), ctypes.addressof(rows), 1,
            out.data_ptr(), heads, kv_heads, head_dim, block, *cache[0].stride()[:3], head_dim ** -0.5,
            cpu.PARTITION_SIZE, None)


def alternate(runs: list[tuple], cold: bool, passes: int) -> list[list[float]]:
    """Microseconds a layer of each pass of each run (kernel, its layers' arguments), the runs in
    turn and their order reversed every other pass, after 5 passes of warm-up; --cold streams 96 MB
    before each."""
    flush = torch.ones(24 << 20) if cold else None
    times: list[list[float]] = [[] for _ in runs]
    for p in range(passes + 5):
        for i in (range(len(runs)) if p % 2 else reversed(range(len(runs)))):
            fn, args = runs[i]
            if flush is not None:
                flush.sum()
            start = time.perf_counter()
            for a in args:
                if fn(*a):
                    raise RuntimeError("the kernel refused the shape")
            if p >= 5:
                times[i].append((time.perf_counter() - start) / len(args) * 1e6)
    return times


def time_layers(heads: int, kv_heads: int, head_dim: int, length: int, cold: bool, layers: int = 30,
                passes: int = 40, other=None) -> tuple[list[float], list[float]]:
    """Microseconds a layer of each pass: this tree's kernel, and `other` (a kernel of the same
    signature, passes alternating with it; [] when None)."""
    from pagedserve.kernels import cpu
    block = 16
    nb = (length + block - 1) // block
    g = torch.Generator().manual_seed(0)
    caches = [torch.randn(2, nb + 4, kv_heads, block, head_dim, generator=g).transpose(2, 3) for _ in range(layers)]
    table = torch.randperm(nb + 4, generator=g)[:nb].view(1, nb)
    q = torch.randn(1, heads, head_dim, generator=g)
    rows = cpu.AttentionRows.of(table, torch.tensor([length]), torch.arange(2), 1, None)
    out = torch.empty(1, heads, head_dim)
    args = [layer_args(q, c, rows, out, kv_heads, block) for c in caches]
    kernels = [cpu._kernel("paged_attention", q)] + ([] if other is None else [other])
    times = alternate([(k, args) for k in kernels], cold, passes)
    return times[0], times[1] if other is not None else []


def time_pages(heads: int, kv_heads: int, head_dim: int, length: int, cold: bool, layers: int = 30,
               passes: int = 40, blocks: int = 2048) -> tuple[list[float], list[float]]:
    """Microseconds a layer of each pass over one engine-shaped bf16 cache: in 4 KiB pages, and in
    huge pages (the same values), passes alternating."""
    from pagedserve.kernels import cpu
    from pagedserve.models import huge_pages
    block = 16
    shape = (layers, 2, blocks, kv_heads, block, head_dim)
    plain = torch.zeros(shape, dtype=torch.bfloat16)
    huge = huge_pages.zeros(shape, torch.bfloat16)
    if huge is None:
        raise SystemExit("--pages: no huge pages here (THP off, or PAGEDSERVE_HUGE_PAGES=0)")
    g = torch.Generator().manual_seed(0)
    plain.normal_(generator=g)
    huge.copy_(plain)
    nb = (length + block - 1) // block
    table = torch.randperm(blocks, generator=g)[:nb].view(1, nb)
    rows = cpu.AttentionRows.of(table, torch.tensor([length]), torch.arange(2), 1, None)
    q = torch.randn(1, heads, head_dim, generator=g).bfloat16()
    fn = cpu._kernel("paged_attention", q)
    out = torch.empty(1, heads, head_dim, dtype=torch.bfloat16)
    runs = [(fn, [layer_args(q, c[i], rows, out, kv_heads, block) for i in range(layers)])
            for c in (plain.transpose(3, 4), huge.transpose(3, 4))]     # head-major, as the runner's
    plain_times, huge_times = alternate(runs, cold, passes)
    return plain_times, huge_times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[16, 160, 330, 1000])
    ap.add_argument("--cold", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--ab-library", default=None, help="another compiled cpu_kernels library to time beside")
    ap.add_argument("--pages", action="store_true", help="one engine-shaped cache, 4 KiB pages against huge pages")
    args = ap.parse_args()
    from pagedserve.kernels import cpu
    other = None
    if args.ab_library:
        mine = cpu._kernel("paged_attention", torch.zeros(1))
        other = ctypes.CDLL(args.ab_library).paged_attention_f32
        other.argtypes, other.restype = mine.argtypes, mine.restype
    simd = sorted(f for f in cpu.cpu_flags() if f.startswith(("avx", "amx", "fma", "f16c")))
    print(f"{cpu.describe().get('cpu_model')}, SIMD flags {' '.join(simd)}, kernels {cpu.describe()['cpu_kernels']}, "
          f"{torch.get_num_threads()} threads, KV {'cold' if args.cold else 'warm (L3)'}"
          + (", one bf16 cache: 4 KiB pages | huge pages" if args.pages else ""))
    rows = []
    for name, (heads, kv_heads, head_dim) in SHAPES.items():
        for length in args.lengths:
            t, o = time_pages(heads, kv_heads, head_dim, length, args.cold) if args.pages else \
                time_layers(heads, kv_heads, head_dim, length, args.cold, other=other)
            rows.append(dict(shape=name, heads=heads, kv_heads=kv_heads, head_dim=head_dim, length=length,
                             median_us=statistics.median(t), best_us=min(t)))
            line = f"{name:<14} length {length:>5}: median {rows[-1]['median_us']:7.1f} us a layer, best {min(t):7.1f}"
            if o:
                rows[-1].update(ab_median_us=statistics.median(o), ab_best_us=min(o))
                line += f"  | {'huge pages' if args.pages else '--ab-library'}: median {statistics.median(o):7.1f}, " \
                        f"best {min(o):7.1f} ({statistics.median(t) / statistics.median(o):.2f}x)"
            print(line)
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(dict(cpu_flags=simd, threads=torch.get_num_threads(), cold=args.cold,
                                       ab_library=args.ab_library, pages=args.pages,
                                       cpu_kernels=cpu.describe()["cpu_kernels"], rows=rows), indent=2))
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
