"""The cost of batch-invariant steps (`--batch-invariant on`, `PAGEDSERVE_BATCH_INVARIANT=1`;
the default `auto` turns it on for steps holding a greedy request, as every workload here is):
the default model's prefill and an offline trace with it off and on, interleaved in one process
(the scheduler reads the engine's setting per step), best of `--repeats`.

    .venv/bin/python benchmarks/batch_invariance.py          # table on stdout, JSON in results/

The switch changes the arithmetic on the avx2 / avxvnni variants (r8 layouts: only mxfp4r8's
prefill rows) and on avx512vnni (quant.INVARIANT_DOTS: every product's rows above the thresholds
take the integer dots instead of the tiles); elsewhere (scalar, torch) it changes nothing, and the
JSON's `switch_applies` says so.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.vs_vllm import cpu_flags, cpu_model  # noqa: E402
from pagedserve import LLM, SamplingParams  # noqa: E402
from pagedserve.kernels import quant  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "batch_invariance.json"


def prompts(n: int, length: int, seed: int, vocab: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(100, vocab - 100) for _ in range(length)]} for _ in range(n)]


def timed(llm: LLM, batch: list[dict], max_tokens: int) -> tuple[float, int]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, min_tokens=max_tokens)
    start = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return seconds, sum(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in outs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    llm = LLM(kv_cache_memory=512 * 1024**2, enable_prefix_caching=False)
    vocab = llm.engine.vocab_size
    workloads = {   # name: (prompts, max_tokens)
        "prefill 8 x 512 tokens": (prompts(8, 512, 0, vocab), 1),
        "trace 16 x (128 in, 64 out)": (prompts(16, 128, 1, vocab), 64),          # one prefill step, then decodes
        "trace 48 x (128 in, 64 out)": (prompts(48, 128, 3, vocab), 64),          # decodes sharing steps with prefills
        "one request (128 in, 128 out)": (prompts(1, 128, 2, vocab), 128),
    }
    timed(llm, workloads["prefill 8 x 512 tokens"][0][:2], 4)   # warm up (kernels, buffers)
    best: dict[str, dict[str, float]] = {name: {} for name in workloads}
    for _ in range(args.repeats):
        for name, (batch, max_tokens) in workloads.items():
            for key in ("off", "on"):
                llm.engine.config.batch_invariant = key      # the scheduler's config: read per step
                seconds, tokens = timed(llm, batch, max_tokens)
                best[name][key] = max(best[name].get(key, 0.0), tokens / seconds)
    rows = [dict(workload=name, off_tok_s=r["off"], on_tok_s=r["on"], on_over_off=r["on"] / r["off"])
            for name, r in best.items()]
    print(f"{'workload':32} {'off tok/s':>10} {'on tok/s':>10} {'on/off':>7}")
    for r in rows:
        print(f"{r['workload']:32} {r['off_tok_s']:10.1f} {r['on_tok_s']:10.1f} {r['on_over_off']:7.3f}")
    result = dict(rows=rows, repeats=args.repeats, variant=quant.variant(),
                  r8_applies=quant.variant() in quant.R8_VARIANTS,
                  switch_applies=quant.variant() in quant.R8_VARIANTS + quant.INVARIANT_DOTS,
                  cpu_model=cpu_model(), cpu_flags=cpu_flags(),
                  threads=os.cpu_count(), date=time.strftime("%Y-%m-%d"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"variant {result['variant']}; CPU: {result['cpu_model']} ({' '.join(result['cpu_flags'])}); wrote {args.out}")


if __name__ == "__main__":
    main()
