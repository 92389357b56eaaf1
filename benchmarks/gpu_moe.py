"""The Triton grouped GEMM for MoE experts (pagedserve/kernels/triton_moe.py) on a GPU: checked and
timed against models/moe.py's loop over experts in torch (what a CUDA MoE model ran before it).

    python3 benchmarks/gpu_moe.py --json OUT.json          # on a CUDA GPU: ~1-2 minutes on an H100
    python3 benchmarks/gpu_moe.py --dry-run                # tiny shapes on the CPU (Triton interpreted)

For each real MoE shape in bf16 (OLMoE-1B-7B, Qwen3-30B-A3B, gpt-oss-20b with its clamped SwiGLU and
biases; random weights, one layer) and each token count (decode batches 1..64, prefill chunks up to
4096 tokens), routed by a random router: the grouped GEMM's max |error| against the torch loop in
float32 on the same bf16 numbers, the time of both (triton.testing.do_bench, L2 flushed), the
weight bytes the chosen experts hold read per second (the decode bound: each chosen expert's weights
once) and TFLOP/s. First, at two token counts per shape, every tile setting in TILE_GRID is timed and
the fastest reported beside `choose_tiles`' (so the next session can tune it; each setting there
compiles for sm_90 within 36-144 KiB of shared memory). scripts/gpu_run.sh runs it after the tests. Timings only mean something on a GPU; the dry run checks the script runs.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton is first imported: CPU dry runs

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedserve.kernels.triton_moe import Tiles, choose_tiles, grouped_moe, stack_experts  # noqa: E402
from pagedserve.models.moe import ExpertWeights, MoESpec, MoEWeights, _experts_one_by_one, route  # noqa: E402
from pagedserve.models.ops import TorchOps  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# name -> (hidden, expert intermediate, experts, top-k, gpt-oss's activation and biases)
# (in the order they run: a run cut short by its time box keeps the first)
SHAPES = {"qwen3-30b-a3b": (2048, 768, 128, 8, False), "gpt-oss-20b": (2880, 2880, 32, 4, True),
          "olmoe-1b-7b": (2048, 1024, 64, 8, False)}
TOKENS = (1, 4, 16, 64, 256, 1024, 4096)
TUNE_AT = (16, 1024)
# (each setting compiles both kernels once per activation: a few seconds each, so a short list)
TILE_GRID = [Tiles(m, n, 64, 4) for m, n in itertools.product((16, 32, 64), (64, 128))] + \
    [Tiles(64, 128, 64, 8), Tiles(16, 64, 128, 4)]
DRY = dict(shapes={"tiny": (64, 32, 8, 2, False), "tiny-gpt-oss": (64, 48, 4, 2, True)}, tokens=(1, 37),
           tune_at=(37,), grid=[Tiles(16, 32, 32), Tiles(32, 64, 64)])


def bench(fn) -> float:
    """Seconds per call (do_bench on a GPU; one timed call in a dry run: meaningless)."""
    if DEVICE.type == "cuda":
        import triton.testing
        return triton.testing.do_bench(fn, warmup=10, rep=40) / 1e3
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def make_layer(hidden: int, inter: int, experts: int, top_k: int, gpt_oss: bool, seed: int = 0):
    """(stacked bf16 experts, their float32 copies for the reference, the MoESpec)."""
    g = torch.Generator(DEVICE).manual_seed(seed)

    def r(*shape, scale):
        return (torch.randn(*shape, generator=g, device=DEVICE) * scale).to(torch.bfloat16)
    ws = [ExpertWeights(r(2 * inter, hidden, scale=hidden ** -0.5), r(hidden, inter, scale=inter ** -0.5),
                        r(2 * inter, scale=0.1) if gpt_oss else None, r(hidden, scale=0.1) if gpt_oss else None)
          for _ in range(experts)]
    spec = MoESpec(experts, top_k, inter, scoring="topk_softmax" if gpt_oss else "softmax",
                   activation="clamped_swiglu" if gpt_oss else "silu", norm_topk_prob=not gpt_oss)
    return stack_experts(ws), ws, spec


def routing(tokens: int, hidden: int, spec: MoESpec, seed: int):
    g = torch.Generator(DEVICE).manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g, device=DEVICE).to(torch.bfloat16)
    weights, ids = route(torch.randn(tokens, spec.num_experts, generator=g, device=DEVICE), spec)
    return x, weights, ids


def run_grouped(x, stack, weights, ids, spec, tiles=None):
    return grouped_moe(x, stack, weights, ids, spec.activation, spec.swiglu_alpha, spec.swiglu_limit, tiles)


def run_loop(x, experts, weights, ids, spec):
    """models/moe.py's loop over the chosen experts through torch's F.linear (TorchOps)."""
    ops = TorchOps()
    w = MoEWeights(torch.zeros(spec.num_experts, x.shape[1], device=DEVICE), experts)
    return _experts_one_by_one(x, w, spec, ops, ops.linear, weights, ids, [])


def tune(stack, spec, hidden: int, tokens: int, grid: list[Tiles]) -> dict:
    x, weights, ids = routing(tokens, hidden, spec, seed=tokens)
    rows = []
    for t in grid:
        try:
            rows.append(dict(tiles=vars(t), us=bench(lambda: run_grouped(x, stack, weights, ids, spec, t)) * 1e6))
        except Exception as e:          # a tile too big for shared memory: say so, go on
            rows.append(dict(tiles=vars(t), error=f"{type(e).__name__}: {e}"[:200]))
    timed = [r for r in rows if "us" in r]
    best = min(timed, key=lambda r: r["us"]) if timed else None
    default = choose_tiles(tokens * spec.top_k, spec.num_experts)
    return dict(tokens=tokens, best=best, default=vars(default),
                default_us=next((r["us"] for r in timed if r["tiles"] == vars(default)), None), rows=rows)


def measure(name: str, shape: tuple, tokens_list: tuple, tune_at: tuple, grid: list[Tiles]) -> dict:
    hidden, inter, experts, top_k, gpt_oss = shape
    stack, ws, spec = make_layer(*shape)
    ref_experts = [ExpertWeights(e.gate_up.float(), e.down.float(),
                                 None if e.gate_up_bias is None else e.gate_up_bias.float(),
                                 None if e.down_bias is None else e.down_bias.float()) for e in ws]
    expert_bytes = (stack.gate_up[0].numel() + stack.down[0].numel()) * 2
    res = dict(shape=dict(hidden=hidden, intermediate=inter, experts=experts, top_k=top_k, gpt_oss=gpt_oss),
               tuning=[tune(stack, spec, hidden, t, grid) for t in tune_at], rows=[])
    for tokens in tokens_list:
        x, weights, ids = routing(tokens, hidden, spec, seed=tokens)
        ours = run_grouped(x, stack, weights, ids, spec)
        ref = run_loop(x.float(), ref_experts, weights, ids, spec)
        err = (ours - ref).abs().max().item() / max(ref.abs().max().item(), 1e-6)
        t_ours = bench(lambda: run_grouped(x, stack, weights, ids, spec))
        t_loop = bench(lambda: run_loop(x, ws, weights, ids, spec))
        chosen = len(set(ids.view(-1).tolist()))
        flops = 2 * tokens * top_k * 3 * hidden * inter
        res["rows"].append(dict(tokens=tokens, experts_chosen=chosen, rel_err=err, ok=err < 3e-2,
                                grouped_us=t_ours * 1e6, loop_us=t_loop * 1e6, speedup=t_loop / t_ours,
                                weights_gb_s=chosen * expert_bytes / t_ours / 1e9, tflops=flops / t_ours / 1e12,
                                tiles=vars(choose_tiles(tokens * top_k, experts))))
        print(f"  {name} T={tokens:<5} experts {chosen:>3}: grouped {t_ours * 1e6:9.1f} us, loop {t_loop * 1e6:9.1f} us "
              f"({t_loop / t_ours:5.1f}x), {chosen * expert_bytes / t_ours / 1e9:7.0f} GB/s of weights, "
              f"{flops / t_ours / 1e12:6.1f} TFLOP/s, rel err {err:.1e}", flush=True)
    res["ok"] = all(r["ok"] for r in res["rows"])
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on whatever device (seconds)")
    ap.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=None)
    ap.add_argument("--json", default=None, help="default benchmarks/results/gpu_moe.json (gpu_moe_dry_run.json)")
    args = ap.parse_args(argv)
    if DEVICE.type != "cuda" and not args.dry_run:
        print("gpu_moe: no CUDA GPU here; --dry-run runs tiny shapes on the CPU", file=sys.stderr)
        return 2
    if DEVICE.type == "cuda" and os.environ.get("TRITON_INTERPRET") == "1":
        print("gpu_moe: unset TRITON_INTERPRET: it makes Triton interpret the kernels", file=sys.stderr)
        return 2
    import triton
    if args.dry_run:
        shapes, tokens, tune_at, grid = DRY["shapes"], DRY["tokens"], DRY["tune_at"], DRY["grid"]
    else:
        shapes = {k: SHAPES[k] for k in (args.shapes or SHAPES)}
        tokens, tune_at, grid = TOKENS, TUNE_AT, TILE_GRID
    name = torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu (dry run)"
    res = dict(device=name, torch=torch.__version__, triton=triton.__version__, dry_run=args.dry_run,
               date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), shapes={})
    out = Path(args.json or ("benchmarks/results/gpu_moe_dry_run.json" if args.dry_run
                             else "benchmarks/results/gpu_moe.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    print(f"gpu_moe on {name}: grouped GEMM vs the torch loop over experts, bf16")
    for key, shape in shapes.items():
        res["shapes"][key] = measure(key, shape, tokens, tune_at, grid)
        for t in res["shapes"][key]["tuning"]:
            best = t["best"]
            print(f"  {key} tuning at T={t['tokens']}: best {best and best['tiles']} {best and best['us']:.1f} us; "
                  f"choose_tiles {t['default']} {t['default_us']}")
        out.write_text(json.dumps(res, indent=2))      # after every shape: a run cut short keeps what it did
    res["ok"] = all(s["ok"] for s in res["shapes"].values())
    out.write_text(json.dumps(res, indent=2))
    print(f"gpu_moe: {'ok' if res['ok'] else 'ERRORS ABOVE TOLERANCE'}; wrote {out}")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
