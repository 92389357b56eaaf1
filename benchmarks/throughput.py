"""Offline throughput: pagedserve vs transformers static batching, and vs the machine's roofline.

    .venv/bin/python benchmarks/throughput.py                      # sharegpt-like, 64 requests, bf16, HF baseline
    .venv/bin/python benchmarks/throughput.py --workload alpaca --num-requests 256
    .venv/bin/python benchmarks/throughput.py --quick              # small, for a smoke run

In the same run it measures the machine's matmul rate (a large GEMM through
torch, before and after the run; the higher reading counts) and read bandwidth, counts the FLOPs the workload needs (2 x weights
touched per token, the LM head only at sampled positions, plus attention) and
prints the achieved fraction of the matmul rate; and times a single request's
decode against the memory-bandwidth bound (weight bytes per token / bandwidth).
"""
from __future__ import annotations

import argparse
import json
import os
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.workloads import TraceRequest, make_trace  # noqa: E402
from pagedserve.kernels import cpu  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


# ---- machine calibration -------------------------------------------------------------------

def matmul_rate(dtype: torch.dtype, n: int = 2048, seconds: float = 2.0) -> float:
    """FLOP/s of a large square GEMM through torch."""
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    torch.mm(a, b)
    iters, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        torch.mm(a, b)
        iters += 1
    return 2 * n ** 3 * iters / (time.perf_counter() - start)


def read_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes/s of streaming reads (a sum over a tensor much larger than the caches): the best of
    4 KiB pages and, where the kernel has them, the huge pages the loader puts quantized weights in
    (faster here: fewer TLB misses)."""
    from pagedserve.models import huge_pages
    buffers = [torch.ones(nbytes // 4, dtype=torch.float32)]
    if huge_pages.available():
        buffers.append(huge_pages.copy_to_huge_pages(buffers[0]))
    best = math.inf
    for x in buffers:
        x.sum()
        for _ in range(repeats):
            start = time.perf_counter()
            x.sum()
            best = min(best, time.perf_counter() - start)
    return nbytes / best


# ---- work accounting -----------------------------------------------------------------------

def model_shape(llm) -> dict:
    a = llm.engine.model_args
    layer = (a.hidden_size * (a.num_heads + 2 * a.num_kv_heads) * a.head_dim     # qkv
             + a.num_heads * a.head_dim * a.hidden_size                             # o
             + 3 * a.hidden_size * a.intermediate_size)                             # gate, up, down
    return dict(layer_params=layer * a.num_layers, lm_head_params=a.vocab_size * a.hidden_size,
                attn_width=a.num_layers * a.num_heads * a.head_dim)


def workload_flops(shape: dict, trace: list[TraceRequest]) -> float:
    """FLOPs the model must do: every prompt and generated token through every layer, the LM
    head once per generated token, attention scores and values over each token's context."""
    total = 0.0
    for r in trace:
        n_in, n_out = len(r.prompt_token_ids), r.output_len
        tokens = n_in + n_out - 1                 # the last sampled token is never fed back
        total += 2 * shape["layer_params"] * tokens + 2 * shape["lm_head_params"] * n_out
        # Token at position p attends over p+1 positions: QK^T and PV, 2 FLOPs per MAC.
        total += 4 * shape["attn_width"] * (tokens * (tokens + 1) / 2)
    return total


# ---- runs ----------------------------------------------------------------------------------

def run_pagedserve(llm, trace: list[TraceRequest]) -> dict:
    from pagedserve import SamplingParams
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in trace]
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in trace]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    assert n_out == sum(r.output_len for r in trace)
    n_in = sum(len(r.prompt_token_ids) for r in trace)
    return dict(seconds=elapsed, output_tokens=n_out, prompt_tokens=n_in,
                output_tok_s=n_out / elapsed, total_tok_s=(n_in + n_out) / elapsed)


def load_hf(model_path: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, GgufConfig
    p = Path(model_path)
    if p.suffix == ".gguf":
        # Float weights (plain nn.Linear in `dtype`), as ours: without dequantize=True transformers
        # keeps the GGUF blocks and dequantizes inside every matmul, a slower baseline.
        return AutoModelForCausalLM.from_pretrained(
            str(p.parent), gguf_file=p.name, dtype=dtype,
            quantization_config=GgufConfig(gguf_file=p.name, dequantize=True)).eval()
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()


def run_hf_static(hf, trace: list[TraceRequest], batch_size: int, pad_id: int) -> dict:
    """transformers' static batching: batches of `batch_size` in arrival order, left-padded,
    each batch generating until its longest request is done."""
    start = time.perf_counter()
    for i in range(0, len(trace), batch_size):
        batch = trace[i:i + batch_size]
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, r in enumerate(batch):
            ids[j, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
            mask[j, width - len(r.prompt_token_ids):] = 1
        new = max(r.output_len for r in batch)
        with torch.inference_mode():
            hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                        do_sample=False, pad_token_id=pad_id)
    elapsed = time.perf_counter() - start
    n_out = sum(r.output_len for r in trace)
    n_in = sum(len(r.prompt_token_ids) for r in trace)
    return dict(seconds=elapsed, output_tokens=n_out, prompt_tokens=n_in,
                output_tok_s=n_out / elapsed, total_tok_s=(n_in + n_out) / elapsed)


def decode_step_times(engine) -> list[float]:
    """Seconds of each decode step of the engine's one request, after its prefill step."""
    engine.step()                                    # prefill + first token
    steps = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
    return steps


def run_single_decode(llm, prompt_len: int, output_len: int, bandwidth: float) -> dict:
    from pagedserve import SamplingParams
    trace = make_trace("sharegpt", 1, seed=1)
    prompt = (trace[0].prompt_token_ids * 64)[:prompt_len]
    p = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    engine = llm.engine
    # The VM's read bandwidth drifts (31-51 GB/s seen); the bound uses the best of the run's
    # measurements, the start one and two taken right around this run, so it is not flattered.
    bandwidths = [bandwidth, read_bandwidth()]
    engine.add_request("single", {"prompt_token_ids": prompt}, p)
    steps = decode_step_times(engine)
    bandwidths.append(read_bandwidth())
    bandwidth = max(bandwidths)
    per_token = sorted(steps)[len(steps) // 2]      # the median step: robust to other jobs' bursts
    # Bytes of the matmul weights (every layer and the LM head), each read once per token.
    shape = model_shape(llm)
    weight_bytes = (shape["layer_params"] + shape["lm_head_params"]) * engine.dtype.itemsize
    model = engine.executor.worker.runner.model
    from pagedserve.models.quantized import is_quantized, weight_nbytes
    if is_quantized(model.lm_head) or any(is_quantized(getattr(w, "qkv", None)) for w in model.layers):
        # quantized weights (a .gguf file in its blocks): the bytes they hold
        weight_bytes = sum(weight_nbytes(getattr(w, n)) for w in model.layers for n in ("qkv", "o", "gate_up", "down")) \
            + weight_nbytes(model.lm_head)
    bound = weight_bytes / bandwidth
    return dict(ms_per_token=per_token * 1e3, tok_s=1 / per_token, weight_bytes=weight_bytes,
                read_bytes_s_measured=bandwidths, read_bytes_s=bandwidth,
                bound_ms_per_token=bound * 1e3, fraction_of_bound=bound / per_token)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--workload", default="sharegpt", choices=["sharegpt", "alpaca"])
    ap.add_argument("--num-requests", type=int, default=None, help="default: 64 sharegpt, 256 alpaca")
    ap.add_argument("--dtype", default="bfloat16", choices=list(DTYPES))
    ap.add_argument("--baseline", default="hf", choices=["hf", "none"])
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--kv-cache-memory", type=int, default=None)
    ap.add_argument("--no-single", action="store_true", help="skip the single-request decode run")
    ap.add_argument("--quick", action="store_true", help="few short requests: a smoke run")
    ap.add_argument("--gguf-dequantize", action="store_true", help="a .gguf model dequantized to --dtype (the float "
                    "path) instead of computed in its blocks")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="default: benchmarks/results/throughput[_alpaca][_fp32][_quick].json, "
                    "one file per workload and dtype")
    ap.add_argument("--cpu-kernels", default=None, choices=["auto", *(v.name for v in cpu.VARIANTS)],
                    help="CPU kernel variant (default: $PAGEDSERVE_CPU_KERNELS, else the best this CPU runs)")
    args = ap.parse_args()
    if args.cpu_kernels:
        os.environ[cpu.ENV_VARIANT] = args.cpu_kernels

    from pagedserve import LLM
    dtype = DTYPES[args.dtype]
    n = args.num_requests or (64 if args.workload == "sharegpt" else 256)
    if args.quick:
        n = min(n, 8)
    trace = make_trace(args.workload, n, seed=args.seed)
    if args.quick:
        for r in trace:
            r.prompt_token_ids = r.prompt_token_ids[:32]
            r.output_len = min(r.output_len, 16)

    print(f"calibrating: {torch.get_num_threads()} threads ...", flush=True)
    # The rate the run is held to: torch's matmul in the run's dtype, but float32 where our
    # kernels compute bf16 in float32 (no AVX512-BF16: torch's own bf16 matmul there is a cliff).
    rate_dtype = torch.float32 if dtype == torch.bfloat16 and cpu.variant() != "avx512bf16" else dtype
    rate = matmul_rate(rate_dtype)
    bw = read_bandwidth()
    t0 = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_memory=args.kv_cache_memory,
              gguf_dequantize=args.gguf_dequantize)
    load_s = time.perf_counter() - t0
    shape = model_shape(llm)
    flops = workload_flops(shape, trace)

    ours = run_pagedserve(llm, trace)
    # The VM's speed drifts: the rate is also measured right after the run, and the higher of
    # the two readings is the one the run is held to.
    rates = [rate, matmul_rate(rate_dtype)]
    rate = max(rates)
    ours["flops"] = flops
    ours["fraction_of_matmul_rate"] = flops / ours["seconds"] / rate
    result = dict(workload=args.workload, num_requests=n, dtype=args.dtype, threads=torch.get_num_threads(),
                  matmul_flop_s=rate, matmul_flop_s_measured=rates, matmul_dtype=str(rate_dtype),
                  read_bytes_s=bw, load_seconds=load_s,
                  mean_prompt_len=ours["prompt_tokens"] / n, mean_output_len=ours["output_tokens"] / n,
                  pagedserve=ours, **cpu.describe())
    if not args.no_single:
        result["single_decode"] = run_single_decode(llm, 128, 16 if args.quick else 256, bw)
    if args.baseline == "hf":
        hf = load_hf(llm.engine.model_path, dtype)
        hf_res = run_hf_static(hf, trace, args.hf_batch_size, llm.get_tokenizer().eos_token_id)
        hf_res["fraction_of_matmul_rate"] = flops / hf_res["seconds"] / rate
        result["hf_static"] = hf_res
        result["speedup_output_tok_s"] = ours["output_tok_s"] / hf_res["output_tok_s"]

    print(f"CPU kernels: {result['cpu_kernels']} ({result['cpu_model']}; {' '.join(result['cpu_flags'])})")
    print(f"\n{args.workload}: {n} requests, mean {result['mean_prompt_len']:.0f} in / "
          f"{result['mean_output_len']:.0f} out, {args.dtype}, {result['threads']} threads")
    print(f"machine: matmul {rate / 1e9:.0f} GFLOP/s ({str(rate_dtype).removeprefix('torch.')}; best of "
          f"{rates[0] / 1e9:.0f} before and "
          f"{rates[1] / 1e9:.0f} after the run), read {bw / 1e9:.1f} GB/s; engine load {load_s:.1f}s")
    print(f"{'system':<28}{'seconds':>9}{'out tok/s':>11}{'total tok/s':>13}{'% matmul':>10}")
    rows = [("pagedserve", ours)] + ([("transformers static (bs %d)" % args.hf_batch_size, result["hf_static"])]
                                     if "hf_static" in result else [])
    for name, r in rows:
        print(f"{name:<28}{r['seconds']:>9.1f}{r['output_tok_s']:>11.1f}{r['total_tok_s']:>13.1f}"
              f"{100 * r['fraction_of_matmul_rate']:>9.1f}%")
    if "speedup_output_tok_s" in result:
        print(f"speedup (output tok/s): {result['speedup_output_tok_s']:.2f}x")
    if "single_decode" in result:
        s = result["single_decode"]
        print(f"single request decode: {s['ms_per_token']:.2f} ms/token ({s['tok_s']:.1f} tok/s); bandwidth bound "
              f"{s['bound_ms_per_token']:.2f} ms/token at {s['read_bytes_s'] / 1e9:.1f} GB/s (best of "
              f"{'/'.join(f'{b / 1e9:.1f}' for b in s['read_bytes_s_measured'])}) -> "
              f"{100 * s['fraction_of_bound']:.0f}% of bound")
    out = Path(args.json or "benchmarks/results/throughput" + ("" if args.workload == "sharegpt" else f"_{args.workload}")
               + ("_fp32" if args.dtype == "float32" else "") + ("_quick" if args.quick else "") + ".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
