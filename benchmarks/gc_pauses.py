"""Python's cyclic garbage collector during serving: how often a full (generation 2) collection
lands inside the engine's steps, how long it pauses them, and the inter-token latency with and
without `gc.freeze()` after the model loads (issue 53's question: a full collection walks every
object the engine and its imports made, ~200k).

    .venv/bin/python benchmarks/gc_pauses.py                       # the default model, no freeze
    .venv/bin/python benchmarks/gc_pauses.py --freeze              # gc.freeze() after the load
    .venv/bin/python benchmarks/gc_pauses.py --model M.gguf --requests 16 --output-len 64

Each run loads the engine, then generates --rounds times: --requests prompts of --input-len random
tokens at once, --output-len tokens each (greedy, ignore_eos). gc.callbacks time every collection;
the engine's step observers stamp every step's end, and the gaps between the ends of steps that
only decode are the inter-token latency (one token per running request per step). Reported: the
objects the collector tracks after the load, one full collection's time then, the collections
per generation during the rounds and the full ones' pauses, the steps a full collection landed
in, and the decode steps' p50 / p99 / max. Results: a line and --out (JSON).
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.vs_vllm import cpu_flags, cpu_model  # noqa: E402
from pagedserve import LLM, SamplingParams  # noqa: E402


class GCWatch:
    """Every collection's generation and pause (gc.callbacks)."""

    def __init__(self) -> None:
        self.counts = [0, 0, 0]
        self.full_pauses: list[float] = []
        self.full_ends: list[float] = []
        self._start = 0.0
        gc.callbacks.append(self)

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        self.counts[info["generation"]] += 1
        if info["generation"] == 2:
            now = time.perf_counter()
            self.full_pauses.append(now - self._start)
            self.full_ends.append(now)


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the default model")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--freeze", action="store_true", help="gc.freeze() after the model loads")
    ap.add_argument("--serve", action="store_true",
                    help="through the OpenAI server's app in process (streamed /v1/completions calls)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gc_pauses.json"))
    args = ap.parse_args()

    if args.serve:
        asyncio.run(serve(args))
        return
    llm = LLM(args.model) if args.model else LLM()
    report(args, llm.engine, lambda prompts, params: llm.generate(prompts, params, use_tqdm=False))


async def serve(args) -> None:
    """--serve: the OpenAI server's app in process (its lifespan and routes on an ASGI transport,
    the AsyncLLM's engine thread), each round's requests streamed /v1/completions calls at once."""
    import httpx

    from pagedserve.config import EngineConfig
    from pagedserve.engine.async_llm import AsyncLLM
    from pagedserve.server.app import build_app
    from pagedserve.server.metrics import PrometheusStatLogger
    from pagedserve.server.state import ServerState

    config = EngineConfig(model=args.model) if args.model else EngineConfig()
    state = ServerState(AsyncLLM(config, log_interval=None), ["m"], PrometheusStatLogger("m"))
    app = build_app(state)
    async with app.router.lifespan_context(app):
        await state.llm.wait_started()
        loop = asyncio.get_running_loop()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=600) as c:
            async def one(prompt: dict, params: SamplingParams) -> None:
                body = dict(model="m", prompt=prompt["prompt_token_ids"], max_tokens=params.max_tokens,
                            temperature=0, ignore_eos=True, stream=True)
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    async for _ in r.aiter_lines():
                        pass

            async def all_of(prompts: list[dict], params: SamplingParams) -> None:
                await asyncio.gather(*(one(p, params) for p in prompts))

            def generate(prompts: list[dict], params: SamplingParams) -> None:
                asyncio.run_coroutine_threadsafe(all_of(prompts, params), loop).result()

            await asyncio.to_thread(report, args, state.llm.engine, generate)


def report(args, engine, generate) -> None:
    """Load's figures, then the rounds (generate(prompts, params) runs one), then the results."""
    gc.collect()
    tracked = len(gc.get_objects())
    start = time.perf_counter()
    gc.collect()
    full_after_load = time.perf_counter() - start
    if args.freeze:
        gc.freeze()
    watch = GCWatch()
    ends: list[tuple[float, bool]] = []      # each step's end; whether the next step only decodes
    sched = engine.scheduler
    engine.step_observers.append(lambda: ends.append(
        (time.perf_counter(), not sched.waiting and len(sched.running) == args.requests)))
    old_before = len(gc.get_objects(generation=2))
    rng = random.Random(0)
    V = engine.vocab_size
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    gaps: list[float] = []
    for _ in range(args.rounds):
        prompts = [{"prompt_token_ids": [rng.randrange(3, V) for _ in range(args.input_len)]}
                   for _ in range(args.requests)]
        ends.clear()
        generate(prompts, params)
        # Decode steps: those that start with every request running and none waiting (no
        # admission, so no prefill, in them).
        gaps += [b - a for (a, decode), (b, _) in zip(ends, ends[1:]) if decode]
    in_steps = len(watch.full_ends)
    old_growth = len(gc.get_objects(generation=2)) - old_before   # toward the next full collection
    result = dict(args=vars(args), cpu_model=cpu_model(), cpu_flags=cpu_flags(), threads=os.cpu_count(),
                  tracked_objects_after_load=tracked, full_collection_after_load_s=full_after_load,
                  collections=watch.counts, gen2_objects_at_load=old_before, gen2_growth_in_run=old_growth, full_pauses_s=watch.full_pauses, full_collections_in_run=in_steps,
                  decode_steps=len(gaps), itl_p50_s=statistics.median(gaps), itl_p99_s=percentile(gaps, 0.99),
                  itl_max_s=max(gaps), itl_mean_s=statistics.fmean(gaps))
    print(f"freeze={args.freeze}: {tracked} objects tracked after the load, a full collection then "
          f"{1000 * full_after_load:.0f} ms; during {args.rounds} rounds: collections per generation "
          f"{watch.counts}, full pauses (ms) {[round(1000 * p) for p in watch.full_pauses]}, the oldest generation "
          f"{old_before} -> {old_before + old_growth} objects; "
          f"{len(gaps)} decode steps: p50 {1000 * result['itl_p50_s']:.1f} ms, p99 {1000 * result['itl_p99_s']:.1f} ms, "
          f"max {1000 * result['itl_max_s']:.1f} ms")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"CPU: {result['cpu_model']} ({' '.join(result['cpu_flags'])}); wrote {args.out}")


if __name__ == "__main__":
    main()
