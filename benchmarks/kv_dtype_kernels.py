"""The attention kernels alone over each KV format: decode at a long context and a prefill chunk,
timed interleaved in one process (formats, and with --against a second build, alternate call by
call; the minimum of each is kept), so the cost of each format's conversion shows under load too.

    .venv/bin/python benchmarks/kv_dtype_kernels.py --quick
    .venv/bin/python benchmarks/kv_dtype_kernels.py --against HEAD~1      # this source vs that commit's
    .venv/bin/python benchmarks/kv_dtype_kernels.py --variant avx2
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/kv_dtype_kernels.py --against HEAD~1   # on a busy machine

On a busy machine use one thread: with two, a call whose other thread is descheduled waits for
it (the minimum over many calls then still holds such waits).

Shapes: SmolLM2-135M's attention (9 query heads, 3 KV heads, 64 dims; decode_mha: 8 query and 8
KV heads, as SmolLM2-1.7B's), bf16 queries, blocks of 16 scattered at random, a buffer larger than
L2 written between calls (every call reads its blocks from memory); `auto` is the bf16 cache. Prints microseconds per call, and per format the
ratio to `auto` (and to the other build with --against). JSON in benchmarks/results/kv_dtype_kernels.json.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from pagedserve.attention.kv_format import kv_format  # noqa: E402
from pagedserve.kernels import cpu  # noqa: E402

FORMATS = ("auto", "fp8_e4m3", "fp8_e5m2", "int8")


def make_case(fmt_name: str, seqs: int, context: int, query_tokens: int, Hq=9, Hkv=3, D=64, B=16, seed=0):
    """A cache in `fmt_name` (head-major inside a block, as the CPU runner stores it), block tables
    and queries: `seqs` sequences of `context` tokens, the last `query_tokens` of each queried."""
    g = torch.Generator().manual_seed(seed)
    per_seq = -(-context // B)
    blocks = seqs * per_seq + 1
    values = torch.randn(2, blocks, B, Hkv, D, generator=g) * torch.rand(2, blocks, B, Hkv, 1, generator=g) * 3
    fmt = kv_format(fmt_name)
    cache = values.to(torch.bfloat16) if not fmt.quantized else fmt.quantize(values)
    cache = cache.transpose(2, 3).contiguous().transpose(2, 3)
    tables = torch.randperm(blocks - 1, generator=g)[:seqs * per_seq].view(seqs, per_seq).to(torch.int64)
    seq_lens = torch.full((seqs,), context, dtype=torch.int64)
    q = torch.randn(seqs * query_tokens, Hq, D, generator=g).to(torch.bfloat16)
    starts = torch.arange(seqs + 1, dtype=torch.int64) * query_tokens
    decode = query_tokens == 1
    per_token = None
    if not decode:      # each query token as a sequence of its own over its causal prefix
        tok_tables = tables.repeat_interleave(query_tokens, 0)
        pos = torch.arange(context - query_tokens + 1, context + 1, dtype=torch.int64)
        per_token = (tok_tables.contiguous(), pos.repeat(seqs).contiguous())
    rows = cpu.AttentionRows.of(tables, seq_lens, starts, seqs if decode else 0, per_token)
    return q, cache, rows, fmt.code


class Evictor:
    """Writes a buffer larger than the caches between calls, so every call reads its KV blocks
    from memory, as a model's layers do in turn (else the second of two calls finds the first's
    blocks in L2 and wins)."""

    def __init__(self, mib: int) -> None:
        self.buf = torch.zeros(mib * 2**20 // 4)

    def __call__(self) -> None:
        self.buf.add_(1.0)


def call(lib, case) -> None:
    q, cache, rows, code = case
    cpu.KERNELS.lib = lib
    cpu._compiled.cache_clear()
    out = cpu.paged_attention(q, cache, rows, 0.125, code)
    assert out is not None


def baseline_library(rev: str, variant: str):
    """The kernels of commit `rev`, built under the same flags."""
    text = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:pagedserve/kernels/cpu_kernels.cpp"],
                          check=True, capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / "cpu_kernels.cpp"
    path.write_text(text)
    lib = cpu.KernelLibrary(path, cpu.VARIANTS, "PAGEDSERVE_UNUSED", cpu._SIGNATURES, "kernel_variant", "baseline",
                            cpu.logger, "baseline kernels (%s) unavailable: %s")
    return lib.load_variant(variant)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer rounds and a shorter context")
    ap.add_argument("--variant", default=None, help="kernel variant (default: the best this CPU runs)")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--against", default=None, help="a git revision whose kernels run interleaved with these")
    ap.add_argument("--shapes", default="decode,decode_batch8,decode_mha,prefill_chunk")
    ap.add_argument("--evict-mib", type=int, default=32, help="buffer written between calls, MiB (0: none)")
    ap.add_argument("--rounds", type=int, default=None, help="calls per (shape, format, build); default by shape")
    ap.add_argument("--json", default="benchmarks/results/kv_dtype_kernels.json")
    args = ap.parse_args()
    variant = args.variant or cpu.choose_variant()
    libs = {"this": cpu.use_variant(variant)}
    if args.against:
        libs[args.against] = baseline_library(args.against, variant)
    context = 1024 if args.quick else 2048
    # Calls per (shape, format, build): the minimum of many short calls is what survives a busy
    # machine; the longer shapes need fewer.
    rounds = {"decode": 300, "decode_batch8": 90, "decode_mha": 150, "prefill_chunk": 30}
    if not args.quick:
        rounds = {k: 2 * v for k, v in rounds.items()}
    if args.rounds:
        rounds = dict.fromkeys(rounds, args.rounds)
    shapes = {"decode": dict(seqs=1, context=context, query_tokens=1),
              "decode_batch8": dict(seqs=8, context=context, query_tokens=1),
              # SmolLM2-1.7B's attention has a KV head per query head (no grouping to share a
              # converted row): 8 of its 32 heads.
              "decode_mha": dict(seqs=1, context=context, query_tokens=1, Hq=8, Hkv=8),
              "prefill_chunk": dict(seqs=1, context=context, query_tokens=64 if args.quick else 256)}
    results: dict = dict(variant=variant, threads=torch.get_num_threads(), context=context, rounds=rounds,
                         **cpu.describe(), timings_us={})
    for shape, kw in shapes.items():
        if shape not in args.shapes.split(","):
            continue
        cases = {f: make_case(f, **kw) for f in args.formats.split(",")}
        best = {(f, name): float("inf") for f in cases for name in libs}
        for name, lib in libs.items():       # warm up (and check each runs)
            for case in cases.values():
                call(lib, case)
        evict = Evictor(args.evict_mib) if args.evict_mib else (lambda: None)
        for i in range(rounds[shape]):
            for f, case in cases.items():
                for name, lib in (list(libs.items()) if i % 2 == 0 else list(libs.items())[::-1]):
                    evict()
                    start = time.perf_counter()
                    call(lib, case)
                    best[f, name] = min(best[f, name], time.perf_counter() - start)
        r = results["timings_us"][shape] = {}
        for f in cases:
            for name in libs:
                us = 1e6 * best[f, name]
                line = dict(us=us)
                if "auto" in cases:
                    line["vs_auto"] = us / (1e6 * best["auto", name])
                if name != "this":
                    line["this_vs_it"] = best[f, "this"] / best[f, name]
                r[f"{f}@{name}"] = line
                print(f"{shape:14s} {f:9s} {name:10s} " + "  ".join(f"{k} {v:.3f}" for k, v in line.items()), flush=True)
    cpu.KERNELS.lib = libs["this"]
    cpu._compiled.cache_clear()
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print("wrote", out)


if __name__ == "__main__":
    main()
