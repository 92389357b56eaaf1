"""A tier hit's forward against the same turn's forward from the pool (issue 53), one engine.

    .venv/bin/python benchmarks/kv_tier_turns.py                    # the 1.7B shape, Q4_0, partial blocks
    .venv/bin/python benchmarks/kv_tier_turns.py --model ''         # the default model: checks the script

8 sessions share a 2048-token prompt (prefilled first); each runs turn 0 (32 new tokens after the
shared prompt, from the pool), then at once turn 1 (the history and its partial block still in
the pool: 33 new tokens), then, after every session did, turns 2 and 3 (the history evicted by the
others: read back from the disk tier). Per kind of turn: mean TTFT, prefill tokens, the forward
(execute), the tier's wait and the engine thread's saves (kv_tier_profile.StepLog). A tier hit
costs what it adds to a pool hit of the same shape (turn 1 against turns 2-3), not against turn 0.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.kv_tier import prefill_steps  # noqa: E402
from benchmarks.kv_tier_profile import StepLog  # noqa: E402
from pagedserve import LLM, SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="/work/peers/files/smollm2-1.7b-shape-Q4_0-llama.gguf")
    ap.add_argument("--no-partial-blocks", action="store_true")
    args = ap.parse_args()
    llm = LLM(args.model or None, block_size=16, num_gpu_blocks_override=152, max_model_len=2048 + 6 * 48,
              kv_offload_path=tempfile.mkdtemp(prefix="kv_tier_turns_"), kv_offload_gb=64,
              enable_partial_block_caching=not args.no_partial_blocks)
    rng = random.Random(5)
    words = lambda n: [rng.randrange(100, llm.engine.vocab_size) for _ in range(n)]  # noqa: E731
    system = words(2048)
    llm.generate([{"prompt_token_ids": system}], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    log, history, rows = StepLog(llm), [list(system) for _ in range(8)], {}

    def turn(k: int, label: str) -> None:
        first = len(log.steps)
        prompt = history[k] + words(32)
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
        history[k] = prompt + list(out.outputs[0].token_ids)
        rows.setdefault(label, []).append(dict(prefill_steps(log.steps[first:]),
                                               ttft_s=out.metrics.first_token_time - out.metrics.arrival_time))

    for k in range(8):
        turn(k, "0: pool, after the shared prompt")
        turn(k, "1: pool, history cached")
    for label in ("2: tier, history evicted", "3: tier, history evicted"):
        for k in range(8):
            turn(k, label)
    for label, got in rows.items():
        m = {k: statistics.fmean(r[k] for r in got) for k in got[0]}
        print(f"{label:34} TTFT {1000 * m['ttft_s']:5.0f} ms  prefill {m['tokens']:4.1f}  execute "
              f"{1000 * m['execute_s']:5.0f} ms (each {[round(1000 * r['execute_s']) for r in got]})  tier wait "
              f"{1000 * m['tier_wait_s']:4.1f} ms  saves {1000 * m['save_s']:3.1f} ms  loads {m['loads']:4.1f}")
    llm.shutdown()


if __name__ == "__main__":
    main()
