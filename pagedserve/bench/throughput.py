"""`pagedserve bench throughput`: offline throughput of --num-prompts requests from
--dataset-name (random: --input-len / --output-len each; sharegpt-like, alpaca-like: the paper's
length statistics), all submitted at once to LLM.generate, as `vllm bench throughput`.

    pagedserve bench throughput --dataset-name sharegpt-like --num-prompts 64 --dtype bfloat16
    pagedserve bench throughput --dataset-name sharegpt-like --hf-baseline --roofline   # the paper's comparison

--hf-baseline runs the same trace through transformers' static batching (--hf-batch-size, left
padded, each batch until its longest request is done) on the same weights. --roofline measures
the machine in the same run (a large GEMM through torch before and after, the higher reading
counts; read bandwidth), counts the FLOPs the workload needs (2 x weights touched per token, the
LM head only at sampled positions, plus attention) and prints the achieved fraction of the matmul
rate; and times a single request's decode against the memory-bandwidth bound (weight bytes per
token / bandwidth).
"""
from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

from pagedserve.bench import report
from pagedserve.bench.datasets import DATASETS, TraceRequest, dataset_trace, make_trace
from pagedserve.kernels import cpu

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
        # a mapping of its own (new_model: not the end of a model's, nor kept by the arena after): a
        # probe between decode rounds (benchmarks/quantized.py's paired_probe) leaves no RSS behind
        huge_pages.new_model()
        buffers.append(huge_pages.copy_to_huge_pages(buffers[0]))
        huge_pages.new_model()
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


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dataset-name", default="random", choices=DATASETS, help="the trace's lengths (default: random)")
    p.add_argument("--input-len", type=int, default=128, help="random: prompt tokens per request (default: 128)")
    p.add_argument("--output-len", type=int, default=128, help="random: generated tokens per request (default: 128)")
    p.add_argument("--num-prompts", type=int, default=64, help="requests (default: 64)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hf-baseline", action="store_true", help="also transformers' static batching, same trace")
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--roofline", action="store_true", help="also the machine's matmul rate and read bandwidth, "
                   "and a single request's decode against its bandwidth bound")
    p.add_argument("--output-json", default=None, help="write the result as JSON here")


def run(config, opts: argparse.Namespace) -> dict:
    from pagedserve import LLM
    t0 = time.perf_counter()
    llm = LLM.from_config(config)
    load_s = time.perf_counter() - t0
    dtype = llm.engine.dtype
    rate_dtype = rate = bw = None
    if opts.roofline:
        print(f"calibrating: {torch.get_num_threads()} threads ...", flush=True)
        # The rate the run is held to: torch's matmul in the run's dtype, but float32 where our
        # kernels compute bf16 in float32 (no AVX512-BF16: torch's own bf16 matmul there is a cliff).
        rate_dtype = torch.float32 if dtype == torch.bfloat16 and cpu.variant() != "avx512bf16" else dtype
        rate, bw = matmul_rate(rate_dtype), read_bandwidth()
    trace = dataset_trace(opts.dataset_name, opts.num_prompts, opts.input_len, opts.output_len, opts.seed,
                          llm.engine.model_args.vocab_size, llm.engine.max_model_len)
    n = len(trace)
    ours = run_pagedserve(llm, trace)
    result = dict(dataset_name=opts.dataset_name, num_prompts=n, threads=torch.get_num_threads(), load_seconds=load_s,
                  requests_per_s=n / ours["seconds"], mean_prompt_len=ours["prompt_tokens"] / n,
                  mean_output_len=ours["output_tokens"] / n, pagedserve=ours)
    if opts.roofline:
        # The VM's speed drifts: the rate is also measured right after the run, and the higher of
        # the two readings is the one the run is held to.
        rates = [rate, matmul_rate(rate_dtype)]
        rate = max(rates)
        ours["flops"] = flops = workload_flops(model_shape(llm), trace)
        ours["fraction_of_matmul_rate"] = flops / ours["seconds"] / rate
        result.update(matmul_flop_s=rate, matmul_flop_s_measured=rates, matmul_dtype=str(rate_dtype), read_bytes_s=bw)
        result["single_decode"] = run_single_decode(llm, 128, 256, bw)
    if opts.hf_baseline:
        hf = load_hf(llm.engine.model_path, dtype)
        hf_res = run_hf_static(hf, trace, opts.hf_batch_size, llm.get_tokenizer().eos_token_id)
        if opts.roofline:
            hf_res["fraction_of_matmul_rate"] = ours["flops"] / hf_res["seconds"] / rate
        result["hf_static"] = hf_res
        result["speedup_output_tok_s"] = ours["output_tok_s"] / hf_res["output_tok_s"]
    llm.shutdown()
    print_result(result, opts)
    report.write_json(opts.output_json, result, {**vars(opts), "engine": vars(config)})
    return result


def print_result(result: dict, opts: argparse.Namespace) -> None:
    ours = result["pagedserve"]
    print(report.title("Throughput Benchmark Result"))
    print(report.row("Dataset", f"{opts.dataset_name} x {result['num_prompts']}"))
    report.print_totals(result["num_prompts"], ours["seconds"], ours["prompt_tokens"], ours["output_tokens"])
    if "hf_static" in result:
        print(report.title(f"transformers static batching (bs {opts.hf_batch_size})", "-"))
        print(report.row("Output token throughput (tok/s)", result["hf_static"]["output_tok_s"]))
        print(report.row("Speedup (output tok/s)", result["speedup_output_tok_s"], "{:.2f}x"))
    if "single_decode" in result:
        s = result["single_decode"]
        print(report.title("Roofline", "-"))
        print(report.row("Matmul rate (GFLOP/s, best of 2)", result["matmul_flop_s"] / 1e9, "{:.0f}"))
        print(report.row("Fraction of matmul rate", 100 * ours["fraction_of_matmul_rate"], "{:.1f}%"))
        print(report.row("Single request decode (ms/token)", s["ms_per_token"]))
        print(report.row("Bandwidth bound (ms/token)", s["bound_ms_per_token"]))
        print(report.row("Fraction of bound", 100 * s["fraction_of_bound"], "{:.0f}%"))
    print("=" * report.WIDTH)
