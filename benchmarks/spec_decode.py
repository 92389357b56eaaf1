"""Speculative decoding (n-gram prompt lookup, suffix) against plain decoding, single stream.

    .venv/bin/python benchmarks/spec_decode.py --quick             # grounded + chat, ngram k = 4, suffix (< 3 min quiet)
    .venv/bin/python benchmarks/spec_decode.py                     # ngram k = 3, 5, 8, a second grounded prompt, batch
    .venv/bin/python benchmarks/spec_decode.py --crossover --quick # step cost of 1 vs 1+k tokens by batch size
    .venv/bin/python benchmarks/spec_decode.py --batch --quick     # ShareGPT/Alpaca-like batches, spec on vs off
    .venv/bin/python benchmarks/spec_decode.py --native            # the GGUF's Q4_1 blocks instead of bf16
    .venv/bin/python benchmarks/spec_decode.py --draft-only --quick # only plain and the draft_model runs

The target is the default model dequantized to bf16 (--native: computed in its Q4_1 blocks).
bf16 runs the compiled layer loop, whose GEMM tiles load each weight once for up to 8 rows,
so a 1+k-token step reads the same bytes as a 1-token one; the Q4_1 kernels are bound by their
integer arithmetic, so there verification costs more per drafted token (see --crossover --native).

Workloads (chat-formatted, one request at a time, greedy):
- grounded: the model is asked to repeat a 600-token section of docs/architecture.md (text the
  project ships); its answer copies from the prompt. `3gram_predictable` (in the plain row) is
  the share of plain decoding's output tokens that a 3-token lookup over prompt + output so far
  predicts: the workload's property, untimed. (With a 1000-token section SmolLM2-135M stops
  copying and invents code: 0.34 predictable; with 600 tokens it copies: 0.72.)
- chat: open-ended questions, where few drafts are accepted (speculation must not lose).
Method draft_model: the draft is the default model's own Q4_1 GGUF computed in its blocks (the
only model sharing the target's tokenizer that the project ships; --draft-model for another),
proposing k greedy tokens per step (k = 3 with --quick; 2 and 4 in the full run). Its step costs
about 0.7 of the bf16 target's, so k draft steps plus the verification cost more than the
tokens they buy unless nearly all drafts are accepted: reported as measured, even where it loses.
`draft_step_ratio` (in the draft rows): one draft-model decode step over one target decode step,
an interleaved A/B in the same process (min of 20), untimed by the engine's loop.
- batch (not with --quick): the chat prompts all at once, with speculation on, to check
  that disable_by_batch_size keeps batches at plain decoding's speed.
Per method: output tok/s, the ratio to plain, acceptance rate, mean accepted length, steps
saved, and how many greedy outputs are identical to plain decoding's (in bf16 a 1+k chunk
rounds differently from a 1-token step, so a near tie may go the other way; float32 is exact).

--crossover: untimed by the engine's loop, an A/B interleaved in one process (min of many):
one forward + LM head for B sequences of 1 query token against B sequences of 1+k, at a
512-token context. The ratio is the mean accepted length a draft needs to pay at batch size B;
the crossover is the first B where it exceeds the grounded run's mean accepted length
(--accepted-length, default 3.2: tokens per decode step, ngram k = 4 on the grounded run).

--batch: ShareGPT-like and Alpaca-like traces (benchmarks/workloads.py, all requests at once),
plain against ngram k = 4 with the default disable_by_batch_size, two engines in one process,
runs alternated (plain, spec, plain, spec), the best of each: spec's output tok/s over plain's.
Writes benchmarks/results/spec_decode[_crossover|_batch|_draft][_native][_quick].json (or --out).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from pagedserve import LLM, SamplingParams  # noqa: E402
from pagedserve.spec_decode import ngram  # noqa: E402

# Lookups of 4 down to 2 tokens: on the grounded run (160 tokens, bf16) ngram k = 4 takes 50 decode
# steps with them against 59 with 3-token lookups only; k = 5 with 2..5, 48; suffix k = 8, 48.
LOOKUP = {"prompt_lookup_min": 2, "prompt_lookup_max": 4}
CHAT = ["Tell me a short story about a robot who learns to paint.",
        "What are three good habits for staying healthy? Explain each briefly.",
        "Why is the sky blue?",
        "Write a friendly email inviting a colleague to lunch."]


def grounded_document(tokenizer, lo: int = 300, hi: int = 600) -> str:
    """Whole paragraphs of docs/architecture.md, from 'The life of a request' on, up to `hi` tokens."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    start = text.find("## The life of a request")
    paras = text[start if start >= 0 else 0:].split("\n\n")
    doc = ""
    for p in paras:
        if len(tokenizer.encode(doc + p)) > hi:
            break
        doc += p + "\n\n"
    if len(tokenizer.encode(doc)) < min(lo, hi // 2):   # paragraphs too long for hi: cut by tokens
        doc = tokenizer.decode(tokenizer.encode("\n\n".join(paras), add_special_tokens=False)[:hi])
    return doc.strip()


def chat_prompt(tokenizer, user: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def predictable(prompt: list[int], output: list[int], n: int = 3) -> float:
    """Share of output tokens a n-token lookup (most recent match) over the tokens before them predicts."""
    tokens = [*prompt, *output]
    hits = sum(ngram.propose(tokens[:len(prompt) + i], 1, n, n) == [t] for i, t in enumerate(output))
    return hits / len(output) if output else 0.0


def spec_stats(llm) -> dict:
    s = llm.kv_cache_stats()
    return {k: s.get(k, 0) for k in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                                     "spec_decode_num_accepted_tokens")}


def run_single(llm, prompts: list[list[int]], max_tokens: int) -> dict:
    """Each prompt alone, greedy; output tokens per second of wall time."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    llm.generate([{"prompt_token_ids": prompts[0][:32]}], SamplingParams(max_tokens=4), use_tqdm=False)   # warm up
    before = spec_stats(llm)
    tokens, outputs, elapsed = 0, [], 0.0
    for p in prompts:
        t0 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0]
        elapsed += time.perf_counter() - t0
        tokens += len(out.token_ids)
        outputs.append(list(out.token_ids))
    after = spec_stats(llm)
    d = {k: after[k] - before[k] for k in after}
    drafts, proposed, acc = d["spec_decode_num_drafts"], d["spec_decode_num_draft_tokens"], \
        d["spec_decode_num_accepted_tokens"]
    return dict(tokens=tokens, seconds=elapsed, tok_s=tokens / elapsed if elapsed else 0.0, outputs=outputs,
                acceptance_rate=acc / proposed if proposed else 0.0,
                mean_accepted_length=1 + acc / drafts if drafts else 1.0, drafts=drafts,
                draft_tokens=proposed, accepted_tokens=acc, decode_steps=tokens - acc)


def run_batch(llm, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)


def step_costs(llm, batch_sizes: list[int], k: int, context: int, rounds: int) -> list[dict]:
    """Interleaved A/B: one forward + LM head (on the rows that sample) of B sequences with 1
    query token, against B with 1 + k (a draft chunk each), min over `rounds` alternations."""
    import torch
    from pagedserve.batch import ScheduledTokens
    runner = llm.engine.runner
    model, bs = runner.model, runner.block_size
    per_seq = context // bs + 2

    def step(b: int, drafts: int) -> float:
        seqs = [ScheduledTokens(seq_id=i, token_ids=[42], start=context,
                                block_ids=list(range(i * per_seq, (i + 1) * per_seq)), draft_token_ids=[7] * drafts)
                for i in range(b)]
        ids, pos, meta = runner._prepare(seqs)
        qsl = meta.query_start_loc_cpu
        rows = [r for i in range(b) for r in range(qsl[i + 1] - 1 - drafts, qsl[i + 1])]
        t0 = time.perf_counter()
        with torch.inference_mode():
            hidden = model.forward(ids, pos, meta, runner.kv_cache)
            model.compute_logits(hidden[rows])
        return time.perf_counter() - t0

    out = []
    for b in batch_sizes:
        step(b, 0), step(b, k)   # warm up
        one, spec = float("inf"), float("inf")
        for _ in range(rounds):
            one, spec = min(one, step(b, 0)), min(spec, step(b, k))
        out.append(dict(batch_size=b, k=k, ms_1=one * 1e3, ms_1_plus_k=spec * 1e3, ratio=spec / one))
    return out


def crossover(args) -> dict:
    sizes = [1, 2, 4, 8] if args.quick else [1, 2, 4, 8, 12, 16, 24, 32]
    k = (args.ks or [4])[0]
    blocks = max(sizes) * (512 // 16 + 2) + 8
    llm = LLM(args.model, dtype=args.dtype, gguf_dequantize=not args.native, num_gpu_blocks_override=blocks)
    rows = step_costs(llm, sizes, k, 512, 10 if args.quick else 30)
    llm.shutdown()
    length = args.accepted_length
    cross = next((r["batch_size"] for r in rows if r["ratio"] > length), None)
    print(f"step cost, 1 vs 1+{k} query tokens per sequence ({'Q4_1 native' if args.native else 'bf16'}, "
          f"512-token context, min of interleaved runs)")
    print(f"{'batch':>6} {'1 tok ms':>9} {'1+k ms':>8} {'ratio':>6} {'bound x':>8}")
    for r in rows:
        r["speedup_bound"] = length / r["ratio"]
        print(f"{r['batch_size']:>6} {r['ms_1']:9.2f} {r['ms_1_plus_k']:8.2f} {r['ratio']:6.2f} "
              f"{r['speedup_bound']:8.2f}")
    print(f"bound x = mean accepted length {length} / ratio; drafts lose from batch size "
          f"{cross if cross is not None else f'> {sizes[-1]}'} (set disable_by_batch_size below it)")
    return dict(k=k, accepted_length=length, rows=rows, crossover_batch_size=cross)


def batch(args) -> dict:
    from benchmarks.workloads import make_trace
    spec = {"method": "ngram", "num_speculative_tokens": 4, **LOOKUP}
    engines = {name: LLM(args.model, dtype=args.dtype, gguf_dequantize=not args.native, speculative_config=cfg)
               for name, cfg in (("plain", None), ("ngram k=4", spec))}
    out = {}
    for workload in ("sharegpt", "alpaca"):
        trace = make_trace(workload, 16 if args.quick else 64, seed=0)
        if args.quick:
            for r in trace:
                r.prompt_token_ids, r.output_len = r.prompt_token_ids[:128], min(r.output_len, 32)
        prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in trace]
        params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in trace]
        best = {name: 0.0 for name in engines}
        for _ in range(2):
            for name, llm in engines.items():
                t0 = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False)
                tokens = sum(len(o.outputs[0].token_ids) for o in outs)
                best[name] = max(best[name], tokens / (time.perf_counter() - t0))
        drafts = engines["ngram k=4"].kv_cache_stats()["spec_decode_num_drafts"]
        out[workload] = dict(num_requests=len(trace), plain_tok_s=best["plain"], spec_tok_s=best["ngram k=4"],
                             ratio=best["ngram k=4"] / best["plain"], spec_drafts_so_far=drafts)
        print(f"{workload:<9} {len(trace)} requests: plain {best['plain']:.1f} tok/s, ngram k=4 "
              f"{best['ngram k=4']:.1f} tok/s, ratio {out[workload]['ratio']:.3f} ({drafts} drafted steps so far)")
    for llm in engines.values():
        llm.shutdown()
    return out


def draft_step_ratio(llm, rounds: int = 20) -> float:
    """One decode step (forward + LM head) of the draft model against one of the target, at a
    256-token context, interleaved (min of `rounds` each): what a draft token costs in target steps."""
    import torch
    from pagedserve.batch import ScheduledTokens
    from pagedserve.worker.model_runner import prepare_batch
    runner = llm.engine.runner
    draft = runner.draft
    seqs = [ScheduledTokens(seq_id=0, token_ids=[42], start=256, block_ids=list(range(256 // runner.block_size + 1)))]

    def step(model, cache) -> float:
        ids, pos, meta = prepare_batch(seqs, runner.block_size, runner.device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.compute_logits(model.forward(ids, pos, meta, cache))
        return time.perf_counter() - t0

    target, proposer = float("inf"), float("inf")
    for _ in range(rounds + 2):
        target = min(target, step(runner.model, runner.kv_cache))
        proposer = min(proposer, step(draft.model, draft.kv_cache))
    return proposer / target


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the default model (SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--native", action="store_true", help="compute a .gguf model in its own blocks (default: "
                                                           "dequantized to --dtype)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--max-tokens", type=int, default=None, help="default: 256 grounded / 128 chat (quick: 160 / 48)")
    ap.add_argument("--ks", type=int, nargs="+", default=None, help="ngram draft lengths (default: 3 5 8; quick: 4)")
    ap.add_argument("--doc-tokens", type=int, default=600, help="most tokens of the grounded document")
    ap.add_argument("--crossover", action="store_true", help="only the step cost of 1 vs 1+k tokens by batch size")
    ap.add_argument("--batch", action="store_true", help="only ShareGPT/Alpaca-like batch throughput, spec on vs off")
    ap.add_argument("--draft-model", default=None, help="method draft_model's draft (default: the default model's "
                                                        "Q4_1 GGUF, computed in its blocks)")
    ap.add_argument("--draft-ks", type=int, nargs="+", default=None, help="draft_model's k (default: 2 4; quick: 3)")
    ap.add_argument("--draft-only", action="store_true", help="single stream: only plain and draft_model")
    ap.add_argument("--accepted-length", type=float, default=3.2, help="with --crossover: the mean accepted length")
    ap.add_argument("--out", default=None, help="default: benchmarks/results/spec_decode[_crossover|_batch]"
                                                "[_native][_quick].json")
    args = ap.parse_args()
    if args.model is not None and not args.model.endswith(".gguf"):
        args.native = True   # gguf_dequantize applies to .gguf files only
    if args.crossover:
        result = dict(crossover=crossover(args))
    elif args.batch:
        result = dict(batch=batch(args))
    else:
        result = dict(results=single_stream(args))
    mode = "_crossover" if args.crossover else "_batch" if args.batch else "_draft" if args.draft_only else ""
    out = Path(args.out or ROOT / "benchmarks" / "results" /
               f"spec_decode{mode}{'_native' if args.native else ''}{'_quick' if args.quick else ''}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(model=args.model or "default", dtype=args.dtype, native=args.native,
                                   quick=args.quick, **result), indent=2))
    print(f"wrote {out}")


def single_stream(args) -> dict:
    ks = args.ks or ([4] if args.quick else [3, 5, 8])
    grounded_tokens = args.max_tokens or (160 if args.quick else 256)
    chat_tokens = args.max_tokens or (48 if args.quick else 128)
    from pagedserve.models.loader import default_model_path
    draft = args.draft_model or default_model_path()
    draft_ks = args.draft_ks or ([3] if args.quick else [2, 4])
    methods = [("plain", None)]
    if not args.draft_only:
        methods += [(f"ngram k={k}", {"method": "ngram", "num_speculative_tokens": k, **LOOKUP}) for k in ks] + \
            [("suffix k=8", {"method": "suffix", "num_speculative_tokens": 8})]
    methods += [(f"draft k={k}", {"method": "draft_model", "model": draft, "num_speculative_tokens": k})
                for k in draft_ks]
    results: dict = {}
    ref_outputs: dict = {}
    for name, spec in methods:
        llm = LLM(args.model, dtype=args.dtype, gguf_dequantize=not args.native, speculative_config=spec)
        tok = llm.get_tokenizer()
        doc = grounded_document(tok, hi=args.doc_tokens)
        grounded = [chat_prompt(tok, "Repeat the following text exactly, word for word:\n\n" + doc)]
        if not args.quick:
            grounded.append(chat_prompt(tok, doc + "\n\nRepeat the text above exactly, word for word."))
        chat = [chat_prompt(tok, q) for q in (CHAT[:2] if args.quick else CHAT)]
        row = {}
        for wname, prompts, n in (("grounded", grounded, grounded_tokens), ("chat", chat, chat_tokens)):
            r = run_single(llm, prompts, n)
            outputs = r.pop("outputs")
            if spec is None:
                ref_outputs[wname] = outputs
                got = sum(len(o) for o in outputs)
                r["3gram_predictable"] = sum(predictable(p, o) * len(o) for p, o in zip(prompts, outputs)) / got
            same = sum(a == b for a, b in zip(outputs, ref_outputs[wname]))
            r["identical_to_plain"] = f"{same}/{len(prompts)}"
            row[wname] = r
        if not args.quick:
            row["batch_tok_s"] = run_batch(llm, chat * 4, chat_tokens)
        if spec is not None and spec["method"] == "draft_model":
            row["draft_model"] = spec["model"]
            row["draft_step_ratio"] = draft_step_ratio(llm)
        results[name] = row
        llm.shutdown()
        del llm

    plain = results["plain"]
    print(f"target: default model {'Q4_1 native' if args.native else args.dtype}; grounded output "
          f"{plain['grounded']['3gram_predictable']:.2f} 3-gram predictable, chat "
          f"{plain['chat']['3gram_predictable']:.2f}")
    print(f"{'method':<12} {'workload':<9} {'tok/s':>8} {'x plain':>8} {'accept':>7} {'mean len':>9} "
          f"{'steps':>6} {'same':>6}")
    for name, row in results.items():
        for w in ("grounded", "chat"):
            r = row[w]
            r["ratio_to_plain"] = r["tok_s"] / plain[w]["tok_s"] if plain[w]["tok_s"] else 0.0
            print(f"{name:<12} {w:<9} {r['tok_s']:8.1f} {r['ratio_to_plain']:8.2f} {r['acceptance_rate']:7.2f} "
                  f"{r['mean_accepted_length']:9.2f} {r['decode_steps']:6d} {r['identical_to_plain']:>6}")
        if "draft_step_ratio" in row:
            print(f"{name:<12} draft step / target step: {row['draft_step_ratio']:.2f}")
        if "batch_tok_s" in row:
            row["batch_ratio_to_plain"] = row["batch_tok_s"] / plain["batch_tok_s"]
            print(f"{name:<12} {'batch16':<9} {row['batch_tok_s']:8.1f} {row['batch_ratio_to_plain']:8.2f}")
    return results


if __name__ == "__main__":
    main()
