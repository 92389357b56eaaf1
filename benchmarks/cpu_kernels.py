"""The CPU kernels against torch, at the default model's shapes (SmolLM2-135M: hidden 576,
9 query / 3 KV heads of 64, MLP 1536, 30 layers), each over 30 layers' worth of distinct data
so weights and KV blocks come from memory as in a real step.

    .venv/bin/python benchmarks/cpu_kernels.py          # ~1 min; table + benchmarks/results/cpu_kernels.json

1. Linear layers y = x W^T for M rows: our GEMM over packed tiles (AVX512-BF16 / AVX-512),
   oneDNN over its packed layout (not used: it caches a primitive per row count, memory that
   grows with every batch size a server sees), torch's F.linear (repacks per call).
2. Paged decode attention, 64 sequences of ~300 tokens in scattered blocks: our kernel over
   token-major and head-major blocks, and the torch reference (gather + SDPA).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pagedserve.attention.metadata import AttentionMetadata  # noqa: E402
from pagedserve.attention.torch_backend import TorchAttention  # noqa: E402
from pagedserve.kernels import cpu  # noqa: E402

LAYERS, HIDDEN, MLP, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 30, 576, 1536, 9, 3, 64, 16
SHAPES = [(HIDDEN + 2 * KV_HEADS * HEAD_DIM, HIDDEN), (HIDDEN, HIDDEN), (2 * MLP, HIDDEN), (HIDDEN, MLP)]


def median_seconds(fn, repeats: int = 7) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def bench_linear(dtype: torch.dtype, rows: list[int]) -> list[dict]:
    weights = [torch.randn(n, k).to(dtype) for _ in range(LAYERS) for n, k in SHAPES]
    params = sum(w.numel() for w in weights)
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in weights]
    ours = [cpu.pack_weight(w) for w in weights]
    variants = {
        "torch F.linear": lambda x, i: F.linear(x, weights[i]),
        "oneDNN packed": lambda x, i: torch.ops.mkldnn._linear_pointwise(x, onednn[i], None, "none", [], ""),
        "ours (packed tiles)": lambda x, i: cpu.linear(x, ours[i]),
    }
    results = []
    for m in rows:
        inputs = {k: torch.randn(m, k).to(dtype) for _, k in SHAPES}
        row = dict(dtype=str(dtype).split(".")[-1], rows=m)
        for name, fn in variants.items():
            sec = median_seconds(lambda: [fn(inputs[k], i) for i, (_, k) in enumerate(SHAPES * LAYERS)])
            row[name] = dict(ms=1e3 * sec, gflops=2 * m * params / sec / 1e9,
                             weight_gbs=params * weights[0].element_size() / sec / 1e9)
        results.append(row)
    return results


def bench_attention(dtype: torch.dtype, batch: int = 64, context: int = 300) -> dict:
    g = torch.Generator().manual_seed(0)
    blocks_per_seq = -(-context // BLOCK)
    num_blocks = batch * blocks_per_seq
    tables = torch.randperm(num_blocks, generator=g).view(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), context, dtype=torch.int64)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=g).to(dtype)
    token_major = [torch.randn(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g).to(dtype) for _ in range(LAYERS)]
    head_major = [c.transpose(2, 3).contiguous().transpose(2, 3) for c in token_major]
    meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.long),
                             query_start_loc=torch.arange(batch + 1), seq_lens=seq_lens, block_tables=tables,
                             num_decodes=batch, query_start_loc_cpu=list(range(batch + 1)),
                             seq_lens_cpu=[context] * batch, max_seq_len=context)
    reference = TorchAttention()
    scale = HEAD_DIM ** -0.5
    kv_bytes = LAYERS * 2 * batch * context * KV_HEADS * HEAD_DIM * q.element_size()
    runs = {
        "ours, token-major blocks": lambda: [cpu.paged_decode_attention(q, c, tables, seq_lens, scale)
                                             for c in token_major],
        "ours, head-major blocks": lambda: [cpu.paged_decode_attention(q, c, tables, seq_lens, scale)
                                            for c in head_major],
        "torch reference (gather + SDPA)": lambda: [reference._decode(q, c, meta, scale) for c in token_major],
    }
    out = dict(dtype=str(dtype).split(".")[-1], batch=batch, context=context, kv_bytes=kv_bytes)
    for name, fn in runs.items():
        sec = median_seconds(fn, repeats=5)
        out[name] = dict(ms=1e3 * sec, gbs=kv_bytes / sec / 1e9)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64, 256, 1024])
    ap.add_argument("--json", default="benchmarks/results/cpu_kernels.json")
    ap.add_argument("--cpu-kernels", default=None, choices=["auto", *(v.name for v in cpu.VARIANTS)],
                    help="CPU kernel variant (default: $PAGEDSERVE_CPU_KERNELS, else the best this CPU runs)")
    args = ap.parse_args()
    if args.cpu_kernels:
        os.environ[cpu.ENV_VARIANT] = args.cpu_kernels
    result = dict(threads=torch.get_num_threads(), **cpu.describe(), linear=[], attention=[])
    print(f"CPU kernels: {result['cpu_kernels']} ({result['cpu_model']}; {' '.join(result['cpu_flags'])})")
    print(f"{torch.get_num_threads()} threads; 30 layers of the default model's shapes per call")
    for dtype in (torch.bfloat16, torch.float32):
        rows = bench_linear(dtype, args.rows)
        result["linear"] += rows
        names = [k for k in rows[0] if k not in ("dtype", "rows")]
        print(f"\nlinear layers, {rows[0]['dtype']}: ms (GFLOP/s)")
        print(f"{'rows':>6}" + "".join(f"{n:>26}" for n in names))
        for r in rows:
            print(f"{r['rows']:>6}" + "".join(f"{r[n]['ms']:>14.1f} ({r[n]['gflops']:>6.1f})    " for n in names))
    for dtype in (torch.bfloat16, torch.float32):
        a = bench_attention(dtype)
        result["attention"].append(a)
        print(f"\npaged decode attention, {a['dtype']}, batch {a['batch']} x context {a['context']}, "
              f"{a['kv_bytes'] / 1e6:.0f} MB of K/V over 30 layers:")
        for name in [k for k in a if isinstance(a[k], dict)]:
            print(f"  {name:<34}{a[name]['ms']:>8.1f} ms {a[name]['gbs']:>6.1f} GB/s")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
