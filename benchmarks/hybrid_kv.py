"""The paper's KV accounting for a hybrid model: a Gemma 3 4B-shaped model (34 layers, 4 KV heads
of 256, a 1024-token window on five layers of six), measured by the engine's own KV manager.

No model runs: which blocks a sequence holds depends only on token counts, so the real
Scheduler and KV cache managers run with the model step replaced by appending a token (as
benchmarks/memory_sim.py). Three caches on the same requests:
- hybrid: pagedserve's paged cache with KV groups (kv/groups.py): a block holds one group's 5
  layers; a window group's blocks go back to the pool behind its window;
- every layer: the paged cache keeping every layer's tokens (one group of all 34 layers: what a
  cache without groups does);
- contiguous: a region reserved per sequence for every layer, at its final length (Orca-Oracle)
  or at max_model_len (Orca-Max), as the paper's baselines.
Reported: KV bytes in use for one sequence at 4k / 32k / 128k context (blocks in use x a block's
bytes, as it decodes its last tokens; and the peak, during a prefill chunk of 4096 tokens), and
how many 32k sequences hold their whole context at once in the same KV memory (many queued,
long enough outputs that memory, not time, limits them).

    .venv/bin/python -m benchmarks.hybrid_kv [--json out.json]

--decode: the per-token goal instead (no step pays for the windows' bookkeeping). A Gemma 3
1B-shaped model (random weights, load_format=dummy, quantized to q4_0 at load: 26 layers, 1 KV
head of 256, window 512 on five layers of six) decodes one sequence at a short context (a
--prompt-token prompt, --decode-tokens tokens) with its windows, and again with every layer full
attention (the window ignored: one KV group); decode tok/s of each over the decode steps alone
(the prompt's step untimed; the best of --rounds), the part of a step spent outside the model (the
scheduler's and worker's per-group bookkeeping), and their ratio. CPU kernels (the compiled layer loop); the machine's flags are recorded.

    .venv/bin/python -m benchmarks.hybrid_kv --decode [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import platform
from dataclasses import asdict, dataclass

from pagedserve.batch import RunnerOutput
from pagedserve.config import EngineConfig
from pagedserve.kv.groups import plan_kv_groups
from pagedserve.request import Request
from pagedserve.sampling_params import SamplingParams
from pagedserve.scheduler import Scheduler
from pagedserve.utils import cdiv

# Gemma 3 4B (google/gemma-3-4b-it's text config): 34 layers, every 6th full, window 1024.
LAYERS, KV_HEADS, HEAD_DIM, WINDOW, PATTERN = 34, 4, 256, 1024, 6
DTYPE_BYTES = 2                       # bf16 K and V
BLOCK = 16
MAX_MODEL_LEN = 131_072
CHUNK = 4096                          # max_num_batched_tokens: the prefill's chunk
LAYER_WINDOWS = [WINDOW if (i + 1) % PATTERN else None for i in range(LAYERS)]
TOKEN_LAYER_BYTES = 2 * KV_HEADS * HEAD_DIM * DTYPE_BYTES   # one token's K and V in one layer


@dataclass
class Cache:
    name: str
    windows: tuple                    # the KV groups' windows given to the scheduler
    layers_per_block: int
    allocator: str = "paged"

    @property
    def block_bytes(self) -> int:
        return self.layers_per_block * BLOCK * TOKEN_LAYER_BYTES


def caches() -> list[Cache]:
    groups = plan_kv_groups(LAYER_WINDOWS)
    return [Cache("hybrid (KV groups)", groups.windows, groups.layers_per_block),
            Cache("every layer (paged)", (None,), LAYERS),
            Cache("contiguous, final length", (None,), LAYERS, "oracle"),
            Cache("contiguous, max_model_len", (None,), LAYERS, "max")]


def scheduler(cache: Cache, num_blocks: int, max_num_seqs: int = 256) -> Scheduler:
    config = EngineConfig(block_size=BLOCK, kv_allocator=cache.allocator, enable_prefix_caching=False,
                          max_num_seqs=max_num_seqs, max_num_batched_tokens=CHUNK, max_model_len=MAX_MODEL_LEN)
    return Scheduler(config, num_blocks, MAX_MODEL_LEN, kv_windows=cache.windows)


def add(sched: Scheduler, rid: str, prompt_len: int, output_len: int) -> Request:
    req = Request.create(rid, None, [1] * prompt_len, SamplingParams(max_tokens=output_len, ignore_eos=True),
                         output_len, sched.new_seq_id())
    sched.add_request(req)
    return req


def step(sched: Scheduler):
    out = sched.schedule()
    if out.empty:
        raise RuntimeError("the scheduler made no progress")
    ids = [s.seq.seq_id for s in out.sampled]
    sched.update_from_output(out, RunnerOutput.of_tokens(ids, [0] * len(ids)))
    return out


def bytes_in_use(cache: Cache, context: int, output: int = 16) -> dict:
    """One sequence reaching `context` tokens (its prompt, then `output` decoded): its KV bytes in
    its last decode step, and the peak over the run, from the manager's used-block counter."""
    sched = scheduler(cache, 4 * cdiv(MAX_MODEL_LEN, BLOCK))
    add(sched, "r", context - output, output)
    peak = last = 0
    while sched.num_unfinished:
        step(sched)
        if sched.num_unfinished:      # (the last step frees the sequence)
            last = sched.kv.num_used_blocks
            peak = max(peak, last)
    return {"blocks": last, "bytes": last * cache.block_bytes, "peak_blocks": peak,
            "peak_bytes": peak * cache.block_bytes}


def concurrency(cache: Cache, kv_bytes: int, prompt_len: int, output: int, requests: int) -> dict:
    """Requests of `prompt_len` + `output` tokens queued at once in `kv_bytes` of KV memory: the
    most sequences holding their whole prompt at the same time, and the preemptions it cost."""
    sched = scheduler(cache, kv_bytes // cache.block_bytes)
    reqs = [add(sched, str(i), prompt_len, output) for i in range(requests)]
    best = steps = 0
    while sched.num_unfinished:
        step(sched)
        steps += 1
        best = max(best, sum(1 for r in sched.running if r.seqs[0].num_computed_tokens >= prompt_len))
    assert all(r.finished for r in reqs)
    return {"num_blocks": kv_bytes // cache.block_bytes, "concurrent_at_context": best,
            "preemptions": sched.stats.num_preemptions, "steps": steps}


# Gemma 3 1B (google/gemma-3-1b-it's config): 26 layers, every 6th full, window 512.
GEMMA3_1B = dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", vocab_size=262144, hidden_size=1152,
                 intermediate_size=6912, num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1,
                 head_dim=256, rms_norm_eps=1e-6, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
                 query_pre_attn_scalar=256, sliding_window=512, max_position_embeddings=32768,
                 hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True, bos_token_id=2, eos_token_id=1)


def decode_speed(config: dict, prompt: int, tokens: int, rounds: int) -> dict:
    """One sequence's decode tok/s over `tokens` decode steps only (the engine stepped by hand: its
    prompt's step and first decode untimed), the best of `rounds`; and of each step's time, the
    part outside the model's forward and LM head (the scheduler's and worker's bookkeeping)."""
    import tempfile
    import time
    from pathlib import Path
    from pagedserve import LLM
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        llm = LLM(tmp, load_format="dummy", dtype="bfloat16", quantization="q4_0", block_size=BLOCK,
                  max_model_len=4096, enable_prefix_caching=False, max_num_seqs=1)
        engine, model = llm.engine, llm.engine.runner.model
        ids = {"prompt_token_ids": [5 + i % 1000 for i in range(prompt)]}
        in_model = [0.0]

        def timed(fn):
            def call(*a, **k):
                start = time.perf_counter()
                out = fn(*a, **k)
                in_model[0] += time.perf_counter() - start
                return out
            return call

        def run(n: int) -> tuple[float, float]:
            engine.add_request(None, ids, SamplingParams(max_tokens=n + 2, ignore_eos=True, temperature=0))
            engine.step()                # the prompt (and its first token)
            engine.step()                # the first decode
            in_model[0] = 0.0
            start = time.perf_counter()
            for _ in range(n):
                engine.step()
            elapsed = time.perf_counter() - start
            while engine.has_unfinished_requests():
                engine.step()
            return elapsed, elapsed - in_model[0]
        run(4)                           # warm-up: kernels, buffers
        model.forward, model.compute_logits = timed(model.forward), timed(model.compute_logits)
        best, outside = min(run(tokens) for _ in range(rounds))
        info = dict(compiled_layer_loop=model.compiled_layers is not None,
                    kv_groups=list(engine.runner.kv_groups.describe()))
        del model, engine, llm
    return dict(tok_s=tokens / best, ms_per_step=1000 * best / tokens, outside_model_ms=1000 * outside / tokens,
                **info)


def decode_goal(args) -> dict:
    from pagedserve.kernels import cpu
    windowed = GEMMA3_1B
    ignored = dict(GEMMA3_1B, layer_types=["full_attention"] * GEMMA3_1B["num_hidden_layers"])
    flags = sorted(f for f in cpu.cpu_flags() if f in ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx_vnni",
                                                        "amx_tile"))
    print(f"Gemma 3 1B shape, q4_0 at load, one sequence: {args.prompt_tokens}-token prompt, {args.decode_tokens} "
          f"decode steps, best of {args.rounds}; CPU flags {' '.join(flags)}, variant {cpu.variant()}")
    out = {"machine": platform.processor() or platform.machine(), "cpu_flags": flags, "variant": cpu.variant(),
           "prompt_tokens": args.prompt_tokens, "decode_tokens": args.decode_tokens}
    for name, config in (("windows", windowed), ("window ignored", ignored)):
        out[name] = r = decode_speed(config, args.prompt_tokens, args.decode_tokens, args.rounds)
        print(f"{name:16}{r['tok_s']:>8.2f} tok/s  {r['ms_per_step']:.2f} ms/step, {r['outside_model_ms']:.2f} outside "
              f"the model (groups {', '.join(r['kv_groups'])}; compiled loop "
              f"{r['compiled_layer_loop']})")
    out["ratio"] = out["windows"]["tok_s"] / out["window ignored"]["tok_s"]
    print(f"windows / window ignored: {out['ratio']:.3f} (goal >= 0.95)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv-gib", type=float, default=20.0, help="KV memory for the concurrency run (GiB)")
    ap.add_argument("--requests", type=int, default=36, help="32k requests queued in the concurrency run")
    ap.add_argument("--output", type=int, default=256, help="tokens each of them decodes")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--decode", action="store_true", help="the decode-speed goal instead (see above)")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    if args.decode:
        results = decode_goal(args)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=2)
        return
    groups = plan_kv_groups(LAYER_WINDOWS)
    results = {"model": {"layers": LAYERS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "window": WINDOW,
                         "full_layers": LAYER_WINDOWS.count(None), "kv_groups": list(groups.describe()),
                         "layers_per_block": groups.layers_per_block, "block_size": BLOCK, "kv_dtype_bytes": 2},
               "machine": platform.processor() or platform.machine(), "contexts": {}, "concurrency": {}}
    print(f"Gemma 3 4B shape: {LAYERS} layers ({LAYER_WINDOWS.count(None)} full), window {WINDOW}, "
          f"groups {len(groups.windows)} x {groups.layers_per_block} layers, block {BLOCK} tokens")
    print(f"\n{'KV bytes in use (GiB)':28}" + "".join(f"{c // 1024:>10}k" for c in (4096, 32768, 131072)))
    for cache in caches():
        row = {}
        for context in (4096, 32768, 131072):
            row[context] = bytes_in_use(cache, context)
        results["contexts"][cache.name] = row
        print(f"{cache.name:28}" + "".join(f"{row[c]['bytes'] / 2**30:>11.2f}" for c in row))
    hybrid = results["contexts"][caches()[0].name]
    print(f"{'  hybrid peak (prefill chunk)':28}" + "".join(f"{hybrid[c]['peak_bytes'] / 2**30:>11.2f}"
                                                            for c in hybrid))
    kv_bytes = int(args.kv_gib * 2**30)
    print(f"\nConcurrent 32k sequences in {args.kv_gib:g} GiB of KV memory ({args.requests} queued, "
          f"{args.output} tokens out)")
    for cache in caches()[:3]:
        r = concurrency(cache, kv_bytes, 32768 - args.output, args.output, args.requests)
        results["concurrency"][cache.name] = r
        print(f"{cache.name:28}{r['concurrent_at_context']:>6} sequences ({r['num_blocks']} blocks, "
              f"{r['preemptions']} preemptions)")
    c = results["concurrency"]
    ratio = c[caches()[0].name]["concurrent_at_context"] / max(1, c[caches()[1].name]["concurrent_at_context"])
    results["concurrency_ratio_vs_every_layer"] = ratio
    print(f"hybrid / every layer: {ratio:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=lambda o: asdict(o))


if __name__ == "__main__":
    main()
