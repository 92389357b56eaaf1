"""Where one engine step's time goes, at a given decode batch size.

    .venv/bin/python benchmarks/profile_step.py --batch 64 [--dtype bfloat16] [--context 300]

Fills the batch (prefills excluded), then times decode steps split into: scheduling,
batch preparation, the model forward (incl. LM head), sampling, and output processing
(appending tokens, stop checks, detokenization, freeing). Engine overhead is everything
outside the forward; the target is < 5% of step time at batch 64.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class Timers:
    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)

    def wrap(self, obj, name: str, label: str) -> None:
        fn = getattr(obj, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total[label] += time.perf_counter() - start
        setattr(obj, name, timed)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=300, help="prompt length of each request")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--json", default="benchmarks/results/profile_step.json")
    args = ap.parse_args()

    from pagedserve import LLM, SamplingParams
    llm = LLM(args.model, dtype=args.dtype)
    engine = llm.engine
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=2 * args.steps + 10, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(str(i), {"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(args.context)]},
                           params)
    while engine.scheduler.waiting or any(s.num_computed_tokens < s.num_tokens - 1
                                          for r in engine.scheduler.running for s in r.live_seqs):
        engine.step()
    engine.step()

    timers = Timers()
    runner = engine.runner
    timers.wrap(engine.scheduler, "schedule", "schedule")
    timers.wrap(runner, "_prepare", "prepare batch")
    timers.wrap(runner.model, "forward", "model forward")
    timers.wrap(runner.model, "compute_logits", "LM head")
    timers.wrap(runner, "sampler", "sample")
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    total = time.perf_counter() - start
    t = dict(timers.total)
    t["output processing"] = total - sum(t.values())

    # Inside the forward: on CPU all layers are one compiled call, so the split comes from
    # the same steps run layer by layer in Python over the same kernels (llama.py's loop over
    # the model's ops; wrapping adds ~1 us per call). Its step time shows what the compiled
    # loop saves.
    compiled = runner.model.compiled_layers
    runner.model.compiled_layers = None
    ops = Timers()
    for name in ("linear", "add_rms_norm", "rotate_queries_and_keys", "silu_and_mul"):
        ops.wrap(runner.model.ops, name, name)
    ops.wrap(runner.model.attention, "forward", "attention")
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    layer_by_layer = time.perf_counter() - start
    runner.model.compiled_layers = compiled
    model = t["model forward"] + t["LM head"]
    overhead = total - model
    print(f"batch {args.batch}, context ~{args.context}, {args.dtype}, {torch.get_num_threads()} threads: "
          f"{1e3 * total / args.steps:.1f} ms/step")
    for name in ("schedule", "prepare batch", "model forward", "LM head", "sample", "output processing"):
        print(f"  {name:<20}{1e3 * t[name] / args.steps:>8.2f} ms {100 * t[name] / total:>6.1f}%")
    print(f"engine overhead (outside the forward): {100 * overhead / total:.1f}% of step time")
    inside = {k: 1e3 * v / args.steps for k, v in sorted(ops.total.items(), key=lambda kv: -kv[1])}
    per_step = 1e3 * layer_by_layer / args.steps
    print(f"inside the forward and LM head, run layer by layer in Python: {per_step:.1f} ms/step "
          f"({'compiled layers: ' + format(1e3 * total / args.steps, '.1f') + ' ms/step' if compiled else 'no compiled layers here'}; "
          "linear includes the LM head):")
    for name, ms in inside.items():
        print(f"  {name:<24}{ms:>8.2f} ms {100 * ms / per_step:>6.1f}%")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(batch=args.batch, context=args.context, dtype=args.dtype,
                                   ms_per_step=1e3 * total / args.steps,
                                   breakdown_ms={k: 1e3 * v / args.steps for k, v in t.items()},
                                   overhead_fraction=overhead / total, compiled_layers=compiled is not None,
                                   layer_by_layer_ms_per_step=per_step, forward_ops_ms=inside), indent=2))


if __name__ == "__main__":
    main()
