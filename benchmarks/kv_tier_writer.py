"""Does the disk tier's background work slow the forward it overlaps (issue 53)? One engine.

    .venv/bin/python benchmarks/kv_tier_writer.py        # the 1.7B shape, Q4_0 (~1 min)
    .venv/bin/python benchmarks/kv_tier_writer.py --model ''   # the default model: checks the script

A 33-token turn after a cached 2048-token shared prompt (a pool hit: the forward of a tier turn
without its reads), --rounds times under each condition, the conditions interleaved round by round:
  idle        nothing else runs
  saves       --saves blocks queued to the tier's writer thread just before (crc32 and a file
              write each, as the blocks a turn evicts are saved during its forward)
  writeback   --dirty blocks written first (untimed), then os.sync() on a thread as the forward
              starts (the kernel's flusher writing the tier's dirty pages to the disk)
Printed: each condition's forward (execute) time, mean and each; the writer's wall time per block
alone. JSON: benchmarks/results/kv_tier_writer.json.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.kv_tier import prefill_steps  # noqa: E402
from benchmarks.kv_tier_profile import StepLog  # noqa: E402
from benchmarks.vs_vllm import cpu_flags, cpu_model  # noqa: E402
from pagedserve import LLM, SamplingParams  # noqa: E402


def queue_saves(store, n: int) -> None:
    """n copies of block 0 filed under fresh keys (the writer thread writes them)."""
    block = store.blocks[:, :, 0].clone()
    store.save_copies([(os.urandom(32), block) for _ in range(n)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="/work/peers/files/smollm2-1.7b-shape-Q4_0-llama.gguf")
    ap.add_argument("--system", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--saves", type=int, default=4, help="blocks saved during a 'saves' forward")
    ap.add_argument("--dirty", type=int, default=32, help="blocks written, then synced during a 'writeback' forward")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "kv_tier_writer.json"))
    args = ap.parse_args()
    tier_dir = tempfile.mkdtemp(prefix="kv_tier_writer_")
    blocks = args.system // 16 + 4 * (args.rounds * 3 + 2)      # no eviction: no saves but ours
    llm = LLM(args.model or None, block_size=16, num_gpu_blocks_override=blocks, max_model_len=args.system + 64,
              kv_offload_path=tier_dir, kv_offload_gb=64)
    store = llm.engine.executor.runner.tier
    rng = random.Random(53)
    words = lambda n: [rng.randrange(100, llm.engine.vocab_size) for _ in range(n)]  # noqa: E731
    system = words(args.system)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate([{"prompt_token_ids": system}], params, use_tqdm=False)
    log = StepLog(llm)

    t0 = time.perf_counter()
    queue_saves(store, 2 * args.saves)
    store.flush()
    write_s = (time.perf_counter() - t0) / (2 * args.saves)

    def forward() -> float:
        first = len(log.steps)
        llm.generate([{"prompt_token_ids": system + words(33)}], params, use_tqdm=False)
        return prefill_steps(log.steps[first:])["execute_s"]

    def writeback() -> float:
        queue_saves(store, args.dirty)
        store.flush()
        syncer = threading.Thread(target=os.sync)
        syncer.start()
        try:
            return forward()
        finally:
            syncer.join()

    def saves() -> float:
        queue_saves(store, args.saves)
        try:
            return forward()
        finally:
            store.flush()

    conditions = {"idle": forward, "saves": saves, "writeback": writeback}
    forward()                                                   # one untimed: first-call costs
    got: dict[str, list[float]] = {name: [] for name in conditions}
    for _ in range(args.rounds):
        for name, fn in conditions.items():
            os.sync()                                           # each starts with no dirty pages
            got[name].append(fn())
    llm.shutdown()
    shutil.rmtree(tier_dir, ignore_errors=True)
    print(f"writer alone: {1000 * write_s:.1f} ms a block ({store.payload_bytes / 1e6:.2f} MB)")
    for name, times in got.items():
        print(f"{name:10} forward {1000 * statistics.fmean(times):6.1f} ms mean, median "
              f"{1000 * statistics.median(times):6.1f} (each {[round(1000 * t) for t in times]})")
    result = dict(args=vars(args), cpu_model=cpu_model(), cpu_flags=cpu_flags(), threads=os.cpu_count(),
                  write_s_per_block=write_s, block_bytes=store.payload_bytes, execute_s=got)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"CPU: {result['cpu_model']} ({' '.join(result['cpu_flags'])}); wrote {args.out}")


if __name__ == "__main__":
    main()
