"""One run on a CUDA GPU that checks and measures the Triton backend.

    .venv/bin/python benchmarks/gpu_check.py            # a few minutes on an H100/H200
    .venv/bin/python benchmarks/gpu_check.py --quick    # smaller sizes, under a minute or two

Sections (each runs even if an earlier one failed; the exit status is 1 if any did):
1. kernels: every Triton kernel (KV write, paged decode with and without the split,
   paged prefill, block copy) against the torch reference computed on the CPU in float32,
   on random batches with scattered block tables, in float32 and bfloat16.
2. decode bandwidth: paged decode attention timed alone (L2 flushed between runs) over
   batch sizes and context lengths; bytes of K/V read per second against the device's
   measured device-to-device copy bandwidth (target: >= 80%). A few launch settings
   are timed first and the fastest is used (and reported).
3. CUDA graphs: the whole model's decode step (all layers and the LM head) for batch
   sizes 1..256, eager against replaying a captured graph; step times and the gain.
4. throughput: the offline engine on a ~1.1B-parameter Llama-shaped model with random
   weights in bfloat16 (TinyLlama's shape), triton backend against the torch backend
   on the same GPU, on the ShareGPT-like workload of benchmarks/workloads.py.

Writes benchmarks/results/gpu_check.json. Without a GPU it says so and exits with 2;
on CPU the kernels are checked by `pytest tests/test_triton_kernels.py` instead.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedserve.attention.metadata import AttentionMetadata  # noqa: E402
from pagedserve.attention.torch_backend import TorchAttention  # noqa: E402

DEVICE = "cuda"
# TinyLlama-1.1B's shape: 22 layers, GQA 32/4, head dim 64, vocab 32000.
MODEL_1B = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                num_key_value_heads=4, vocab_size=32000, max_position_embeddings=4096)


# ---- random paged batches ------------------------------------------------------------------

def random_batch(specs: list[tuple[int, int]], block_size: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, seed: int = 0):
    """specs: (cached tokens, new tokens) per sequence, decodes (new == 1) first. Returns
    float32 CPU tensors (cache with random contents, q, k, v) and CPU metadata; physical
    blocks are a random permutation, so every table is scattered and out of order."""
    g = torch.Generator().manual_seed(seed)
    needed = [math.ceil((c + n) / block_size) for c, n in specs]
    num_blocks = sum(needed) + 8
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, slots, qsl, lens = [], [], [0], []
    for (ctx, new), nb in zip(specs, needed):
        table = [perm.pop() for _ in range(nb)]
        tables.append(table)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(ctx, ctx + new)]
        qsl.append(qsl[-1] + new)
        lens.append(ctx + new)
    width = max(needed)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(qsl), seq_lens=torch.tensor(lens),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        num_decodes=sum(1 for _, n in specs if n == 1), query_start_loc_cpu=qsl, seq_lens_cpu=lens,
        max_seq_len=max(lens))
    t = qsl[-1]
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    q = torch.randn(t, num_heads, head_dim, generator=g)
    k = torch.randn(t, num_kv_heads, head_dim, generator=g)
    v = torch.randn(t, num_kv_heads, head_dim, generator=g)
    return cache, q, k, v, meta


def meta_to(meta: AttentionMetadata, device) -> AttentionMetadata:
    return AttentionMetadata(meta.slot_mapping.to(device), meta.query_start_loc.to(device),
                             meta.seq_lens.to(device), meta.block_tables.to(device), meta.num_decodes,
                             meta.query_start_loc_cpu, meta.seq_lens_cpu, meta.max_seq_len)


# ---- 1. kernels against the reference ------------------------------------------------------

KERNEL_CASES = [
    # name, specs (cached, new), block size, Hq, Hkv, D
    ("decode 64 seqs, GQA 8, D128", [(random.Random(1).randrange(1, 2000), 1) for _ in range(64)], 16, 32, 4, 128),
    ("decode long (16k) + short, GQA 1, D64", [(16000, 1), (3, 1), (700, 1)], 32, 8, 8, 64),
    ("decode 33 seqs, GQA 3, D128, block 32", [(i * 37, 1) for i in range(33)], 32, 12, 4, 128),
    ("prefill fresh + cached prefixes, GQA 8", [(0, 300), (1000, 77), (64, 16), (5000, 200)], 16, 32, 4, 128),
    ("mixed decodes + prefills, GQA 3, D64", [(10, 1), (900, 1), (0, 129), (33, 64)], 32, 12, 4, 64),
]


def check_kernels(quick: bool) -> list[dict]:
    from pagedserve.attention.triton_backend import TritonAttention
    from pagedserve.attention.triton_cache_ops import copy_blocks
    rows = []
    cases = KERNEL_CASES[1:3] + KERNEL_CASES[4:] if quick else KERNEL_CASES
    for name, specs, bs, hq, hkv, d in cases:
        for dtype in (torch.float32, torch.bfloat16):
            cache, q, k, v, meta = random_batch(specs, bs, hq, hkv, d, seed=len(rows))
            cache, q, k, v = (x.to(dtype).float() for x in (cache, q, k, v))   # same values for both sides
            scale = d ** -0.5
            ref_cache = cache.clone()
            ref = TorchAttention().forward(q, k, v, ref_cache, meta, scale)
            gpu_cache = cache.to(DEVICE, dtype)
            dev = DEVICE
            out = TritonAttention(dev).forward(q.to(dev, dtype), k.to(dev, dtype), v.to(dev, dtype),
                                               gpu_cache, meta_to(meta, dev), scale)
            err = (out.float().cpu() - ref).abs().max().item()
            cache_ok = torch.equal(gpu_cache.float().cpu(), ref_cache)
            tol = 1e-4 if dtype == torch.float32 else 3e-2
            rows.append(dict(case=name, dtype=str(dtype).removeprefix("torch."), max_abs_err=err,
                             cache_equal=cache_ok, ok=err <= tol and cache_ok))
    # Block copy: copy-on-write in place, and to a staging buffer (swap).
    big = torch.randn(4, 2, 64, 16, 8, 128, device=DEVICE, dtype=torch.bfloat16)
    expected = big.clone()
    pairs = [(3, 40), (0, 5), (63, 1), (3, 9)]
    for s, t in pairs:
        expected[:, :, t] = expected[:, :, s]
    copy_blocks(big, big, pairs)
    staging = torch.zeros(4, 2, 2, 16, 8, 128, device=DEVICE, dtype=torch.bfloat16)
    copy_blocks(big, staging, [(40, 1)])
    ok = torch.equal(big, expected) and torch.equal(staging[:, :, 1], expected[:, :, 40])
    rows.append(dict(case="copy_blocks (CoW in place, and to a staging buffer)", dtype="bfloat16",
                     max_abs_err=0.0, cache_equal=ok, ok=ok))
    return rows


# ---- 2. decode bandwidth -------------------------------------------------------------------

def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Bytes/s moved (read + written) by a large device-to-device copy."""
    import triton.testing
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=10, rep=100)
    return 2 * nbytes / (ms / 1e3)


def decode_setup(batch: int, ctx: int, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int = 16):
    """A bfloat16 decode batch on the GPU: every sequence has `ctx` tokens in scattered blocks."""
    per_seq = math.ceil(ctx / block_size)
    num_blocks = batch * per_seq
    perm = torch.randperm(num_blocks, device="cuda")
    tables = perm.view(batch, per_seq)
    cache = torch.empty(2, num_blocks, block_size, num_kv_heads, head_dim, device="cuda",
                        dtype=torch.bfloat16).normal_()
    q = torch.randn(batch, num_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    seq_lens = torch.full((batch,), ctx, device="cuda", dtype=torch.long)
    kv_bytes = batch * ctx * num_kv_heads * head_dim * 2 * 2          # K and V, 2 bytes each
    other = q.numel() * 2 * 2 + tables.numel() * 8 + batch * 8           # q in, out, table, lengths
    return q, cache, tables, seq_lens, kv_bytes + other


def time_decode(q, cache, tables, seq_lens, ctx) -> float:
    import triton.testing
    from pagedserve.attention.triton_decode import paged_decode_attention
    out = torch.empty_like(q)
    fn = lambda: paged_decode_attention(q, cache, tables, seq_lens, 0.125, ctx, out=out)  # noqa: E731
    return triton.testing.do_bench(fn, warmup=10, rep=50) / 1e3


DECODE_CONFIGS = [  # (BLOCK_N, NUM_WARPS, NUM_STAGES); the first is the code's default
    (64, 4, 3), (64, 8, 3), (32, 4, 3), (128, 8, 2), (64, 4, 2), (128, 4, 3)]


def bench_decode(quick: bool, copy_bw: float) -> dict:
    from pagedserve.attention import triton_decode as td
    default = (td.BLOCK_N, td.NUM_WARPS, td.NUM_STAGES)
    # Llama-3-8B's attention shape per layer (GQA 32/8, head dim 128) and TinyLlama's (32/4, 64).
    shapes = [(32, 8, 128), (32, 4, 64)]
    tune_at = (64, 2048)
    configs = []
    for cfg in DECODE_CONFIGS[:3] if quick else DECODE_CONFIGS:
        td.BLOCK_N, td.NUM_WARPS, td.NUM_STAGES = cfg
        q, cache, tables, lens, nbytes = decode_setup(*tune_at, *shapes[0])
        try:
            sec = time_decode(q, cache, tables, lens, tune_at[1])
            configs.append(dict(block_n=cfg[0], num_warps=cfg[1], num_stages=cfg[2], us=sec * 1e6,
                                gb_s=nbytes / sec / 1e9))
        except Exception as e:   # a setting this GPU cannot compile: report, keep going
            configs.append(dict(block_n=cfg[0], num_warps=cfg[1], num_stages=cfg[2], error=repr(e)[:200]))
        del q, cache, tables, lens
    timed = [c for c in configs if "gb_s" in c]
    best = max(timed, key=lambda c: c["gb_s"]) if timed else dict(block_n=default[0], num_warps=default[1],
                                                                    num_stages=default[2])
    td.BLOCK_N, td.NUM_WARPS, td.NUM_STAGES = best["block_n"], best["num_warps"], best["num_stages"]
    grid = [(1, 4096), (8, 4096), (64, 1024), (64, 4096), (256, 2048)] if quick else \
        [(1, 1024), (1, 32768), (8, 4096), (32, 8192), (64, 1024), (64, 4096), (128, 2048), (256, 1024), (256, 4096)]
    rows = []
    try:
        for hq, hkv, d in shapes:
            for batch, ctx in grid:
                q, cache, tables, lens, nbytes = decode_setup(batch, ctx, hq, hkv, d)
                sec = time_decode(q, cache, tables, lens, ctx)
                rows.append(dict(heads=f"{hq}/{hkv}x{d}", batch=batch, context=ctx, us=sec * 1e6,
                                 gb_s=nbytes / sec / 1e9, fraction_of_copy=nbytes / sec / copy_bw))
                del q, cache, tables, lens
                torch.cuda.empty_cache()
    finally:
        td.BLOCK_N, td.NUM_WARPS, td.NUM_STAGES = default
    return dict(copy_gb_s=copy_bw / 1e9, configs=configs, used=best, default=list(default), rows=rows)


# ---- 3. CUDA graphs for the decode step ----------------------------------------------------

def random_llama(shape: dict, dtype: torch.dtype, device: str, attention):
    """A LlamaModel with random weights, built directly on `device`."""
    from pagedserve.models.llama import LlamaModel, ModelArgs
    from pagedserve.models.loader import DictSource, build_model
    h, i, n = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    hq, hkv = shape["num_attention_heads"], shape["num_key_value_heads"]
    d = h // hq
    args = ModelArgs(architecture="LlamaForCausalLM", vocab_size=shape["vocab_size"], hidden_size=h,
                     intermediate_size=i, num_layers=n, num_heads=hq, num_kv_heads=hkv, head_dim=d,
                     rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None,
                     max_position_embeddings=shape["max_position_embeddings"], tie_word_embeddings=False,
                     qkv_bias=False)
    g = torch.Generator(device=device).manual_seed(0)

    def w(*size):
        return (torch.randn(*size, generator=g, device=device, dtype=torch.float32) * 0.02).to(dtype)

    weights = {"embed_tokens.weight": w(args.vocab_size, h), "norm.weight": torch.ones(h, device=device, dtype=dtype),
               "lm_head.weight": w(args.vocab_size, h)}
    for layer in range(n):
        p = f"layers.{layer}."
        weights |= {p + "input_layernorm.weight": torch.ones(h, device=device, dtype=dtype),
                    p + "post_attention_layernorm.weight": torch.ones(h, device=device, dtype=dtype),
                    p + "self_attn.q_proj.weight": w(hq * d, h), p + "self_attn.k_proj.weight": w(hkv * d, h),
                    p + "self_attn.v_proj.weight": w(hkv * d, h), p + "self_attn.o_proj.weight": w(h, hq * d),
                    p + "mlp.gate_proj.weight": w(i, h), p + "mlp.up_proj.weight": w(i, h),
                    p + "mlp.down_proj.weight": w(h, i)}
    model: LlamaModel = build_model(args, DictSource(weights), dtype, attention, args.max_position_embeddings)
    return model.to(torch.device(device)), weights


def bench_cuda_graphs(quick: bool) -> dict:
    from pagedserve.attention.triton_backend import TritonAttention
    model, weights = random_llama(MODEL_1B, torch.bfloat16, "cuda", TritonAttention("cuda"))
    del weights
    a = model.args
    ctx, max_len, block_size = 512, 1024, 16       # each sequence holds 512 tokens; graphs allow up to 1024
    sizes = [1, 8, 32, 64] if quick else [1, 8, 16, 32, 64, 128, 256]
    per_seq = max_len // block_size
    kv = torch.zeros(a.num_layers, 2, max(sizes) * per_seq, block_size, a.num_kv_heads, a.head_dim,
                     device="cuda", dtype=torch.bfloat16)
    rows = []
    for b in sizes:
        tables = torch.randperm(b * per_seq, device="cuda").view(b, per_seq)
        positions = torch.full((b,), ctx, device="cuda", dtype=torch.long)
        slots = tables[:, ctx // block_size] * block_size + ctx % block_size
        meta = AttentionMetadata(slot_mapping=slots, query_start_loc=torch.arange(b + 1, device="cuda"),
                                 seq_lens=positions + 1, block_tables=tables, num_decodes=b,
                                 query_start_loc_cpu=list(range(b + 1)), seq_lens_cpu=[ctx + 1] * b,
                                 max_seq_len=max_len)   # the bound the launch is sized for, as a graph needs
        ids = torch.randint(100, a.vocab_size, (b,), device="cuda")

        def step():
            return model.compute_logits(model.forward(ids, positions, meta, kv))

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):                      # compile the kernels, settle the allocator
                eager_logits = step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graph_logits = step()
        graph.replay()
        torch.cuda.synchronize()
        same = (graph_logits - eager_logits).abs().max().item()
        eager_ms = _time(step, 20) * 1e3
        graph_ms = _time(graph.replay, 50) * 1e3
        rows.append(dict(batch=b, eager_ms=eager_ms, graph_ms=graph_ms, gain=eager_ms / graph_ms,
                         max_abs_diff_vs_eager=same))
        del graph, graph_logits, eager_logits
        torch.cuda.empty_cache()
    return dict(model="TinyLlama-1.1B shape, random bf16", context=ctx, rows=rows)


def _time(fn, iters: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters


# ---- 4. engine throughput ------------------------------------------------------------------

def save_random_model(root: Path) -> str:
    """An HF directory (config, bf16 safetensors, word-level tokenizer over the vocabulary)."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    _, weights = random_llama(MODEL_1B, torch.bfloat16, DEVICE, attention=None)
    save_file({"model." + k if k != "lm_head.weight" else k: t.cpu().contiguous() for k, t in weights.items()},
              str(root / "model.safetensors"))
    del weights
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", torch_dtype="bfloat16", rms_norm_eps=1e-5,
               rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, **MODEL_1B)
    (root / "config.json").write_text(json.dumps(cfg))
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, MODEL_1B["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(str(root))
    return str(root)


def bench_throughput(quick: bool) -> dict:
    from benchmarks.workloads import make_trace
    from pagedserve import LLM, SamplingParams
    n = 64 if quick else 256
    trace = make_trace("sharegpt", n, seed=0, vocab_size=MODEL_1B["vocab_size"], max_model_len=2048)
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in trace]
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in trace]
    n_in, n_out = sum(len(r.prompt_token_ids) for r in trace), sum(r.output_len for r in trace)
    result = dict(model="TinyLlama-1.1B shape, random bf16", workload="sharegpt", num_requests=n,
                  prompt_tokens=n_in, output_tokens=n_out)
    with tempfile.TemporaryDirectory() as tmp:
        path = save_random_model(Path(tmp))
        for backend in ("triton", "torch"):
            llm = LLM(path, dtype="bfloat16", device=DEVICE, attention_backend=backend, max_model_len=2048,
                      max_num_seqs=256, max_num_batched_tokens=4096)
            warm = prompts[:4]                                       # warm-up: kernel compilation
            llm.generate(warm, [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)] * len(warm),
                         use_tqdm=False)
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            sec = time.perf_counter() - start
            assert sum(len(o.outputs[0].token_ids) for o in outs) == n_out
            stats = llm.kv_cache_stats()
            result[backend] = dict(seconds=sec, output_tok_s=n_out / sec, total_tok_s=(n_in + n_out) / sec,
                                   num_blocks=stats.get("num_blocks"), preemptions=stats.get("num_preemptions"))
            del llm, outs
            gc.collect()
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
    result["speedup_output_tok_s"] = result["triton"]["output_tok_s"] / result["torch"]["output_tok_s"]
    return result


# ---- report --------------------------------------------------------------------------------

def print_report(res: dict) -> None:
    print(f"\n== {res['device']} | torch {res['torch']} | triton {res['triton']}")
    if isinstance(res.get("kernels"), list):
        print("\n-- kernels vs torch reference (CPU, float32)")
        for r in res["kernels"]:
            print(f"{'ok ' if r['ok'] else 'BAD'} {r['case']:<52}{r['dtype']:>10}  max|err| {r['max_abs_err']:.2e}"
                  f"  cache {'equal' if r['cache_equal'] else 'DIFFERS'}")
    dec = res.get("decode")
    if isinstance(dec, dict):
        print(f"\n-- paged decode attention (bf16, block 16); device copy bandwidth {dec['copy_gb_s']:.0f} GB/s")
        for c in dec["configs"]:
            print(f"   config BLOCK_N={c['block_n']:<4} warps={c['num_warps']} stages={c['num_stages']}: "
                  + (f"{c['gb_s']:.0f} GB/s" if "gb_s" in c else c["error"]))
        u = dec["used"]
        print(f"   using BLOCK_N={u['block_n']} warps={u['num_warps']} stages={u['num_stages']} "
              f"(code default {dec['default']})")
        print(f"{'heads':>10}{'batch':>7}{'context':>9}{'us':>10}{'GB/s':>9}{'% copy':>9}")
        for r in dec["rows"]:
            print(f"{r['heads']:>10}{r['batch']:>7}{r['context']:>9}{r['us']:>10.1f}{r['gb_s']:>9.0f}"
                  f"{100 * r['fraction_of_copy']:>8.0f}%")
    gr = res.get("cuda_graphs")
    if isinstance(gr, dict):
        print(f"\n-- decode step, {gr['model']}, context {gr['context']}: eager vs CUDA graph")
        print(f"{'batch':>7}{'eager ms':>10}{'graph ms':>10}{'gain':>7}{'max|diff|':>11}")
        for r in gr["rows"]:
            print(f"{r['batch']:>7}{r['eager_ms']:>10.2f}{r['graph_ms']:>10.2f}{r['gain']:>6.2f}x"
                  f"{r['max_abs_diff_vs_eager']:>11.1e}")
    tp = res.get("throughput")
    if isinstance(tp, dict):
        print(f"\n-- engine throughput, {tp['model']}, {tp['num_requests']} {tp['workload']} requests "
              f"({tp['prompt_tokens']} in / {tp['output_tokens']} out)")
        for b in ("triton", "torch"):
            r = tp[b]
            print(f"{b + ' backend':<16}{r['seconds']:>8.1f}s{r['output_tok_s']:>10.0f} out tok/s"
                  f"{r['total_tok_s']:>10.0f} total tok/s  {r['num_blocks']} KV blocks")
        print(f"speedup (output tok/s): {tp['speedup_output_tok_s']:.2f}x")
    for key in ("kernels", "decode", "cuda_graphs", "throughput"):
        if isinstance(res.get(key), str):
            print(f"\n!! {key} failed: {res[key].splitlines()[-1]}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller sizes: a smoke run")
    ap.add_argument("--skip", action="append", default=[], choices=["kernels", "decode", "cuda_graphs", "throughput"])
    ap.add_argument("--json", default="benchmarks/results/gpu_check.json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print(f"gpu_check: torch {torch.__version__} sees no CUDA GPU, and this script measures one. "
              "Run it on a machine with an NVIDIA GPU and a CUDA build of torch. On CPU, the Triton "
              "kernels are checked under Triton's interpreter by `pytest tests/test_triton_kernels.py`.",
              file=sys.stderr)
        return 2
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("gpu_check: unset TRITON_INTERPRET: it makes Triton interpret the kernels instead of compiling them",
              file=sys.stderr)
        return 2
    import triton
    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               quick=args.quick)
    failed = False
    copy_bw = None
    for key, run in [("kernels", lambda: check_kernels(args.quick)),
                     ("decode", lambda: bench_decode(args.quick, copy_bw)),
                     ("cuda_graphs", lambda: bench_cuda_graphs(args.quick)),
                     ("throughput", lambda: bench_throughput(args.quick))]:
        if key in args.skip:
            continue
        if key == "decode":
            copy_bw = copy_bandwidth()
        start = time.perf_counter()
        print(f"[gpu_check] {key} ...", flush=True)
        try:
            res[key] = run()
            failed |= key == "kernels" and not all(r["ok"] for r in res[key])
        except Exception:
            res[key] = traceback.format_exc()
            print(res[key], file=sys.stderr)
            failed = True
        res.setdefault("seconds", {})[key] = time.perf_counter() - start
        gc.collect()
        torch.cuda.empty_cache()
    print_report(res)
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    print(f"\nwrote {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
