"""Structured outputs: what a grammar costs per decode step, and what a compile costs.

For each batch size (default 1 and 64): the same prompts decode for --steps steps
unconstrained and then constrained by a JSON schema (an open-ended array of objects, so no
sequence ends early), with the default model (greedy sampling is not used: temperature 1.0,
seeded). Reported per batch size: median decode step time with and without the grammar, and the
time spent filling the token bitmask (scheduler side) and applying it (sampler side) per step,
as a share of the constrained step (the goal: under 5% at batch 64). Then the compile of a
typical schema: building xgrammar's view of the tokenizer (once per engine), the first compile
of the schema, and the same schema again (a cache hit).

    .venv/bin/python benchmarks/structured.py            # the lead's run (a few minutes on 2 cores)
    .venv/bin/python benchmarks/structured.py --smoke    # seconds: checks it works

Writes benchmarks/results/structured.json and prints a markdown table.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from pagedserve import LLM, SamplingParams, StructuredOutputsParams
from pagedserve.sampling.sampler import Sampler
import pagedserve.scheduler as scheduler_module
from pagedserve.structured.manager import GrammarCompiler

RESULTS = Path(__file__).parent / "results" / "structured.json"

# Open-ended: the array may go on, so constrained sequences run for all the steps.
OPEN_SCHEMA = {"type": "array", "items": {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"},
    "role": {"enum": ["admin", "user", "guest"]}}, "required": ["name", "age", "role"]}}
# A typical response_format schema, for the compile times.
TYPICAL_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string", "pattern": "^[a-z0-9.]+@[a-z0-9.]+$"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                                     "zip": {"type": "string"}}, "required": ["city"]},
    },
    "required": ["name", "age", "role", "address"],
}
PROMPT = "List the people in the team as JSON:"


class Timers:
    """Time spent in the bitmask fill (scheduler) and its application (sampler)."""

    def __init__(self) -> None:
        self.fill = 0.0
        self.apply = 0.0
        self._fill = scheduler_module.fill_bitmask
        self._apply = Sampler._apply_grammar

    def __enter__(self) -> "Timers":
        def fill(rows):
            t = time.perf_counter()
            try:
                return self._fill(rows)
            finally:
                self.fill += time.perf_counter() - t

        def apply(logits, idx, bitmask):
            t = time.perf_counter()
            try:
                return self._apply(logits, idx, bitmask)
            finally:
                self.apply += time.perf_counter() - t
        scheduler_module.fill_bitmask = fill
        Sampler._apply_grammar = staticmethod(apply)
        return self

    def __exit__(self, *exc) -> None:
        scheduler_module.fill_bitmask = self._fill
        Sampler._apply_grammar = staticmethod(self._apply)


def decode_steps(llm: LLM, batch: int, steps: int, constraint: StructuredOutputsParams | None) -> dict:
    """Median decode step time (the prefill steps and the first decode left out)."""
    engine = llm.engine
    for i in range(batch):
        engine.add_request(None, PROMPT, SamplingParams(temperature=1.0, seed=i, max_tokens=steps + 2,
                                                        ignore_eos=True, structured_outputs=constraint))
    times = []
    with Timers() as timers:
        while engine.has_unfinished_requests():
            if engine.only_waiting_for_grammars():
                engine.wait_for_grammars()
                continue
            before = (timers.fill, timers.apply)
            t = time.perf_counter()
            engine.step()
            times.append((time.perf_counter() - t, timers.fill - before[0], timers.apply - before[1]))
    decode = times[2:-1] or times
    step = statistics.median(t for t, _, _ in decode)
    fill = statistics.median(f for _, f, _ in decode)
    apply = statistics.median(a for _, _, a in decode)
    return {"steps": len(decode), "step_ms": step * 1e3, "fill_ms": fill * 1e3, "apply_ms": apply * 1e3}


def compile_times(llm: LLM) -> dict:
    engine = llm.engine
    compiler = GrammarCompiler(engine.tokenizer, engine.vocab_size, engine.eos_token_ids)
    t = time.perf_counter()
    compiler._xgrammar_compiler()
    info_s = time.perf_counter() - t
    params = StructuredOutputsParams(json=TYPICAL_SCHEMA)
    t = time.perf_counter()
    compiler.compile(params).result()
    first_s = time.perf_counter() - t
    again = StructuredOutputsParams(json=TYPICAL_SCHEMA)   # parsing it is the request's, not the cache's
    t = time.perf_counter()
    compiler.compile(again).result()
    cached_s = time.perf_counter() - t
    compiler.close()
    return {"tokenizer_info_ms": info_s * 1e3, "first_compile_ms": first_s * 1e3, "cached_ms": cached_s * 1e3}


def run(llm: LLM, batch_sizes: list[int], steps: int) -> dict:
    constraint = StructuredOutputsParams(json=OPEN_SCHEMA)
    decode_steps(llm, 1, 2, constraint)   # warm up: the compiler, the kernels
    rows = []
    for batch in batch_sizes:
        free = decode_steps(llm, batch, steps, None)
        bound = decode_steps(llm, batch, steps, constraint)
        mask_ms = bound["fill_ms"] + bound["apply_ms"]
        rows.append({"batch": batch, "unconstrained": free, "constrained": bound,
                     "bitmask_share": mask_ms / bound["step_ms"],
                     "slowdown": bound["step_ms"] / free["step_ms"]})
    return {"steps": steps, "rows": rows, "compile": compile_times(llm)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    p.add_argument("--steps", type=int, default=48, help="decode steps per run")
    p.add_argument("--smoke", action="store_true", help="batch 1 and 4, 6 steps: checks the script works")
    p.add_argument("--model", default=None)
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args()
    if args.smoke:
        args.batch_sizes, args.steps = [1, 4], 6
    llm = LLM(args.model, max_num_seqs=max(args.batch_sizes))
    result = run(llm, args.batch_sizes, args.steps)
    result["smoke"] = args.smoke
    rows, compiles = result["rows"], result["compile"]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))

    print("| batch | step, unconstrained (ms) | step, JSON schema (ms) | bitmask fill (ms) | bitmask apply (ms) "
          "| bitmask share of step | constrained / unconstrained |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        c = r["constrained"]
        print(f"| {r['batch']} | {r['unconstrained']['step_ms']:.2f} | {c['step_ms']:.2f} | {c['fill_ms']:.3f} | "
              f"{c['apply_ms']:.3f} | {100 * r['bitmask_share']:.1f}% | {r['slowdown']:.2f}x |")
    print()
    print("| typical schema | ms |")
    print("|---|---:|")
    print(f"| tokenizer info (once per engine) | {compiles['tokenizer_info_ms']:.1f} |")
    print(f"| first compile | {compiles['first_compile_ms']:.1f} |")
    print(f"| cached | {compiles['cached_ms']:.3f} |")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
