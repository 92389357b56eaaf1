"""Speculative decoding (n-gram prompt lookup) against plain decoding, single stream.

    .venv/bin/python benchmarks/spec_decode.py            # the default model, bf16: k = 3 and 5
    .venv/bin/python benchmarks/spec_decode.py --quick    # fewer tokens, k = 3 only, and suffix (< 5 min)
    .venv/bin/python benchmarks/spec_decode.py --model PATH --dtype float32 --max-tokens 8 --doc-tokens 200

Workloads (chat-formatted, one request at a time):
- grounded: the model is asked to repeat a section of docs/architecture.md (a few hundred
  tokens the project ships): its answer copies from the prompt, where prompt lookup pays.
- chat: open-ended questions, where few drafts are accepted (speculation must not lose).
- batch (not with --quick): the chat prompts all at once, with speculation on, to check
  that disable_by_batch_size keeps batches at plain decoding's speed.
Per method: output tok/s, the ratio to plain, acceptance rate, mean accepted length, and how
many greedy outputs are identical to plain decoding's. Writes benchmarks/results/spec_decode.json.
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

CHAT = ["Tell me a short story about a robot who learns to paint.",
        "What are three good habits for staying healthy? Explain each briefly.",
        "Why is the sky blue?",
        "Write a friendly email inviting a colleague to lunch."]


def grounded_document(tokenizer, lo: int = 300, hi: int = 1000) -> str:
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
        outputs.append(out.token_ids)
    after = spec_stats(llm)
    d = {k: after[k] - before[k] for k in after}
    drafts, proposed, acc = d["spec_decode_num_drafts"], d["spec_decode_num_draft_tokens"], \
        d["spec_decode_num_accepted_tokens"]
    return dict(tokens=tokens, seconds=elapsed, tok_s=tokens / elapsed if elapsed else 0.0, outputs=outputs,
                acceptance_rate=acc / proposed if proposed else 0.0,
                mean_accepted_length=1 + acc / drafts if drafts else 1.0, drafts=drafts)


def run_batch(llm, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the default model (SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--max-tokens", type=int, default=None, help="default: 256 grounded / 128 chat (quick: 96 / 48)")
    ap.add_argument("--ks", type=int, nargs="+", default=None, help="draft lengths (default: 3 5; quick: 3)")
    ap.add_argument("--doc-tokens", type=int, default=1000, help="most tokens of the grounded document")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "spec_decode.json"))
    args = ap.parse_args()
    ks = args.ks or ([3] if args.quick else [3, 5])
    grounded_tokens = args.max_tokens or (96 if args.quick else 256)
    chat_tokens = args.max_tokens or (48 if args.quick else 128)

    methods = [("plain", None)] + [(f"ngram k={k}", {"method": "ngram", "num_speculative_tokens": k,
                                                      "prompt_lookup_min": 2, "prompt_lookup_max": 4})
                                   for k in ks] + [("suffix", {"method": "suffix", "num_speculative_tokens": max(ks)})]
    results: dict = {}
    ref_outputs: dict = {}
    for name, spec in methods:
        llm = LLM(args.model, dtype=args.dtype, speculative_config=spec)
        tok = llm.get_tokenizer()
        doc = grounded_document(tok, hi=args.doc_tokens)
        grounded = [chat_prompt(tok, "Repeat the following text exactly, word for word:\n\n" + doc)]
        if not args.quick:
            grounded.append(chat_prompt(tok, "Copy this document, fixing any typos:\n\n" + doc))
        chat = [chat_prompt(tok, q) for q in (CHAT[:2] if args.quick else CHAT)]
        row = {}
        for wname, prompts, n in (("grounded", grounded, grounded_tokens), ("chat", chat, chat_tokens)):
            r = run_single(llm, prompts, n)
            if spec is None:
                ref_outputs[wname] = r["outputs"]
            same = sum(a == b for a, b in zip(r.pop("outputs"), ref_outputs[wname]))
            r["identical_to_plain"] = f"{same}/{len(prompts)}"
            row[wname] = r
        if not args.quick:
            row["batch_tok_s"] = run_batch(llm, chat * 4, chat_tokens)
        results[name] = row
        llm.shutdown()
        del llm

    plain = results["plain"]
    print(f"{'method':<12} {'workload':<9} {'tok/s':>8} {'x plain':>8} {'accept':>7} {'mean len':>9} {'same':>6}")
    for name, row in results.items():
        for w in ("grounded", "chat"):
            r = row[w]
            r["ratio_to_plain"] = r["tok_s"] / plain[w]["tok_s"] if plain[w]["tok_s"] else 0.0
            print(f"{name:<12} {w:<9} {r['tok_s']:8.1f} {r['ratio_to_plain']:8.2f} {r['acceptance_rate']:7.2f} "
                  f"{r['mean_accepted_length']:9.2f} {r['identical_to_plain']:>6}")
        if "batch_tok_s" in row:
            row["batch_ratio_to_plain"] = row["batch_tok_s"] / plain["batch_tok_s"]
            print(f"{name:<12} {'batch16':<9} {row['batch_tok_s']:8.1f} {row['batch_ratio_to_plain']:8.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(model=args.model or "default", dtype=args.dtype, quick=args.quick,
                                   results=results), indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
