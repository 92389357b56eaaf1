"""The 8-bit KV cache against the 16-bit one (kv_cache_dtype: auto, fp8_e4m3 = fp8, fp8_e5m2, int8).

    .venv/bin/python benchmarks/kv_dtype.py                 # SmolLM2-135M, every part, every format
    .venv/bin/python benchmarks/kv_dtype.py --quick         # small sizes (a few minutes)
    .venv/bin/python benchmarks/kv_dtype.py --parts capacity,decode --formats auto,int8

Parts, per format:
- capacity: blocks in the same kv_cache_memory (this model, and SmolLM2-1.7B's shape: 32 KV
  heads x 64 dims x 24 layers), bytes per token; no timing.
- decode: single-stream decode at a 2k-token context (median ms per token), and attention's
  share of a step there (the same steps run layer by layer, attention timed; profile_step.py's way).
- throughput: batch-64 ShareGPT-like (benchmarks/workloads.py, throughput.py's run), tokens/s,
  and attention's share of a decode step at that batch.
- small_budget: the same trace in a KV budget where the 16-bit cache preempts (the paper's
  regime): throughput, preemptions and recomputed tokens side by side.
- quality: greedy agreement on the 12-prompt set (tests/test_default_model.py, 32 tokens) with
  transformers' float32 oracle (the engine in float32 on the same dequantized weights, so only
  the KV cache differs) and with the 16-bit cache, and the mean |logprob - 16-bit cache's| of a
  2k-token prompt (bf16 model).
The last lines printed sum each format up (attention's share of the step beside each speed).
JSON in benchmarks/results/kv_dtype.json.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pagedserve.bench.throughput import decode_step_times, run_pagedserve  # noqa: E402
from benchmarks.workloads import make_trace, trace_stats  # noqa: E402
from pagedserve.kernels import cpu  # noqa: E402

FORMATS = ("auto", "fp8_e4m3", "fp8_e5m2", "int8")
PARTS = ("capacity", "decode", "throughput", "small_budget", "quality")
CHAT = ("What is 2+2?", "Name a fruit.")


def make_llm(args, kv: str, **kw):
    from pagedserve import LLM
    kw.setdefault("dtype", args.dtype)
    kw.setdefault("kv_cache_memory", args.kv_cache_memory)
    return LLM(args.model, kv_cache_dtype=kv, enable_prefix_caching=False, **kw)


class AttentionTimer:
    """Attention's share of decode steps: the steps run layer by layer in Python (the compiled
    loop off) with the attention backend's forward timed, as profile_step.py splits a step."""

    def __init__(self, model) -> None:
        self.model, self.seconds = model, 0.0
        self._forward = model.attention.forward

    def __enter__(self):
        self._compiled, self.model.compiled_layers = self.model.compiled_layers, None

        def timed(*a, **k):
            start = time.perf_counter()
            try:
                return self._forward(*a, **k)
            finally:
                self.seconds += time.perf_counter() - start
        self.model.attention.forward = timed
        return self

    def __exit__(self, *exc) -> None:
        self.model.attention.forward = self._forward
        self.model.compiled_layers = self._compiled


def attention_share(engine, steps: int) -> dict:
    """Runs `steps` decode steps of what the engine holds; attention's share of them."""
    with AttentionTimer(engine.runner.model) as timer:
        start = time.perf_counter()
        for _ in range(steps):
            if not engine.has_unfinished_requests():
                break
            engine.step()
        total = time.perf_counter() - start
    return dict(attention_share=timer.seconds / total if total else None, layer_by_layer_s=total)


def capacity(args, kv: str) -> dict:
    from pagedserve.worker.model_runner import kv_cache_bytes_per_block
    llm = make_llm(args, kv, num_gpu_blocks_override=None)
    stats = llm.kv_cache_stats()
    dtype = llm.engine.dtype
    big = kv_cache_bytes_per_block(24, 16, 32, 64, dtype, kv)      # SmolLM2-1.7B's KV shape
    return dict(num_blocks=stats["num_blocks"], kv_cache_memory=args.kv_cache_memory,
                kv_cache_dtype=stats["kv_cache_dtype"], kv_bytes_per_token=stats["kv_bytes_per_token"],
                smollm2_1_7b=dict(bytes_per_token=big // 16, blocks=args.kv_cache_memory // big))


def decode(args, kv: str) -> dict:
    from pagedserve import SamplingParams
    llm = make_llm(args, kv)
    engine = llm.engine
    prompt = (make_trace("sharegpt", 1, seed=1, vocab_size=llm.engine.vocab_size)[0].prompt_token_ids * 64)[:args.context]
    params = SamplingParams(temperature=0, max_tokens=args.decode_tokens, ignore_eos=True)
    engine.add_request("single", {"prompt_token_ids": prompt}, params)
    steps = decode_step_times(engine)
    per_token = sorted(steps)[len(steps) // 2]
    engine.add_request("single-profiled", {"prompt_token_ids": prompt}, params)
    engine.step()                                       # the prefill
    share = attention_share(engine, args.decode_tokens)
    while engine.has_unfinished_requests():
        engine.step()
    return dict(context=args.context, ms_per_token=1e3 * per_token, tok_s=1 / per_token, **share)


def throughput(args, kv: str, trace, **kw) -> dict:
    llm = make_llm(args, kv, **kw)
    result = run_pagedserve(llm, trace)
    stats = llm.kv_cache_stats()
    result.update(num_blocks=stats["num_blocks"], num_preemptions=stats["num_preemptions"],
                  num_recomputed_tokens=stats["num_recomputed_tokens"])
    # Attention's share of a decode step with the whole batch running (prefills done).
    from pagedserve import SamplingParams
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=args.profile_steps + 2, ignore_eos=True)
    for i, r in enumerate(trace[:args.batch]):
        engine.add_request(f"p{i}", {"prompt_token_ids": r.prompt_token_ids}, params)
    while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_tokens - 1
                                          for r in engine.scheduler.running for s in r.live_seqs):
        engine.step()
    result.update(attention_share(engine, args.profile_steps))
    while engine.has_unfinished_requests():
        engine.step()
    return result


def oracle_tokens(args, prompts: list[str], tok) -> list[list[int]]:
    """transformers' float32 greedy tokens for `prompts` (the default model: its GGUF file,
    dequantized by transformers itself): the oracle every format is compared with."""
    from transformers import AutoModelForCausalLM
    from pagedserve.models.loader import default_model_path
    path = Path(args.model or default_model_path())
    kw = dict(gguf_file=path.name) if path.suffix == ".gguf" else {}
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent if kw else path), dtype=torch.float32, **kw).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = tok.encode(p)
            gen = hf.generate(torch.tensor([ids]), max_new_tokens=args.quality_tokens,
                              min_new_tokens=args.quality_tokens, do_sample=False, pad_token_id=tok.eos_token_id)
            out.append(gen[0, len(ids):].tolist())
    return out


def first_divergences(tokens, reference) -> list[int | None]:
    return [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in zip(tokens, reference)]


def quality(args, kv: str, reference: dict) -> dict:
    """Greedy agreement on the 12-prompt set with transformers' float32 oracle (the engine in
    float32 on the same dequantized weights, so only the KV cache differs) and with the 16-bit
    cache; the mean |logprob - the 16-bit cache's| of a long prompt (bf16 model)."""
    from pagedserve import SamplingParams
    from tests.test_default_model import PROMPTS
    gguf = dict(gguf_dequantize=True) if args.model is None or str(args.model).endswith(".gguf") else {}
    llm = make_llm(args, kv, dtype="float32", **gguf)
    tok = llm.get_tokenizer()
    chat = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
            for q in CHAT]
    prompts = (PROMPTS + chat)[:args.quality_prompts]
    if "oracle" not in reference:
        reference["oracle"] = oracle_tokens(args, prompts, tok)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.quality_tokens,
                                                min_tokens=args.quality_tokens), use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    reference.setdefault("tokens", tokens)           # auto (float32 cache) runs first
    oracle = first_divergences(tokens, reference["oracle"])
    firsts = first_divergences(tokens, reference["tokens"])
    del llm
    # Logprobs of a long prompt, bf16 model: this cache against the 16-bit one.
    llm16 = make_llm(args, kv, dtype="bfloat16", **gguf)
    rng = random.Random(5)
    text = " ".join(rng.choice(PROMPTS) for _ in range(4 * args.context // 8))
    ids = tok.encode(text)[:args.context]
    out = llm16.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=0),
                         use_tqdm=False)[0]
    lps = torch.tensor([out.prompt_logprobs[i][t].logprob for i, t in enumerate(ids) if i > 0])
    reference.setdefault("logprobs", lps)
    return dict(prompts=len(prompts), tokens=args.quality_tokens,
                oracle_greedy_agree=sum(f is None for f in oracle), oracle_first_divergence=oracle,
                oracle_tokens_agree=sum(next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x))
                                        for x, y in zip(tokens, reference["oracle"])),
                greedy_agree_16bit=sum(f is None for f in firsts), first_divergence_16bit=firsts,
                logprob_context=len(ids),
                logprob_mean_abs_diff=(lps - reference["logprobs"]).abs().mean().item(),
                logprob_max_abs_diff=(lps - reference["logprobs"]).abs().max().item())


def summary(results: dict) -> list[str]:
    """One line per format, what the issue's goals read: capacity, each speed beside attention's
    share of the step it was measured in, preemptions, quality against the oracle."""
    def pct(x):
        return "-" if x is None else f"{100 * x:.1f}%"
    lines = []
    for kv, r in results["formats"].items():
        cols = [f"{kv:9s}"]
        if "capacity" in r:
            cols.append(f"blocks {r['capacity']['num_blocks']}")
        if "decode" in r:
            cols.append(f"decode {r['decode']['tok_s']:.1f} tok/s (attention {pct(r['decode']['attention_share'])})")
        if "throughput" in r:
            t = r["throughput"]
            cols.append(f"batch {t['output_tok_s']:.1f} tok/s (attention {pct(t['attention_share'])})")
        if "small_budget" in r:
            t = r["small_budget"]
            cols.append(f"small budget {t['output_tok_s']:.1f} tok/s, {t['num_preemptions']} preemptions")
        if "quality" in r:
            q = r["quality"]
            cols.append(f"greedy = oracle {q['oracle_greedy_agree']}/{q['prompts']} "
                        f"(= 16-bit {q['greedy_agree_16bit']}/{q['prompts']}), "
                        f"logprob diff {q['logprob_mean_abs_diff']:.3f}")
        lines.append(" | ".join(cols))
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    ap.add_argument("--kv-cache-memory", type=int, default=2 * 1024**3)
    ap.add_argument("--json", default="benchmarks/results/kv_dtype.json")
    args = ap.parse_args()
    formats, parts = args.formats.split(","), args.parts.split(",")
    assert formats[0] == "auto" or "quality" not in parts, "quality compares with auto: list it first"
    quick = args.quick
    args.context = 256 if quick else 2048
    args.decode_tokens = 8 if quick else 64
    args.batch = 8 if quick else 64
    args.profile_steps = 4 if quick else 16
    args.quality_prompts, args.quality_tokens = (4, 12) if quick else (12, 32)
    if quick:
        args.kv_cache_memory = min(args.kv_cache_memory, 256 * 1024**2)
    probe = make_llm(args, "auto").engine           # the model's vocabulary and context
    trace = make_trace("sharegpt", args.batch, seed=0, vocab_size=probe.vocab_size,
                       max_model_len=min(2048, probe.max_model_len), scale=0.25 if quick else 1.0)
    del probe

    results: dict = dict(quick=quick, model=args.model or "SmolLM2-135M-Instruct", dtype=args.dtype,
                         threads=torch.get_num_threads(), **cpu.describe(), trace=trace_stats(trace), formats={})
    # The small budget: a quarter of the KV blocks the 16-bit cache needs for the whole batch at
    # once, in bytes of that cache, the same bytes for every format.
    small_memory = None
    reference: dict = {}
    for kv in formats:
        r = results["formats"].setdefault(kv, {})
        for part in parts:
            start = time.perf_counter()
            if part == "capacity":
                r[part] = capacity(args, kv)
            elif part == "decode":
                r[part] = decode(args, kv)
            elif part == "throughput":
                r[part] = throughput(args, kv, trace)
            elif part == "small_budget":
                if small_memory is None:
                    from pagedserve.worker.model_runner import kv_cache_bytes_per_block
                    llm = make_llm(args, "auto")
                    a, block = llm.engine.model_args, 16
                    per_request = [-(-(len(t.prompt_token_ids) + t.output_len) // block) for t in trace]
                    small_memory = max(sum(per_request) // 4, 2 * max(per_request)) * kv_cache_bytes_per_block(
                        a.num_layers, block, a.num_kv_heads, a.head_dim, llm.engine.dtype)
                    results["small_budget_kv_cache_memory"] = small_memory
                r[part] = throughput(args, kv, trace, kv_cache_memory=small_memory, admission_watermark=0.0)
            elif part == "quality":
                r[part] = quality(args, kv, reference)
            r[part]["wall_s"] = time.perf_counter() - start
            print(kv, part, json.dumps(r[part]), flush=True)
    results["summary"] = summary(results)
    print("\n".join(results["summary"]))
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print("wrote", out)


if __name__ == "__main__":
    main()
