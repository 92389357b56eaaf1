"""Where one single-stream decode step's time goes, beside the weight-read bound.

    .venv/bin/python benchmarks/decode_profile.py [--model FILE.gguf --tokenizer DIR] [--rounds 3]

Loads the model (default: the default model, SmolLM2-135M-Instruct Q4_1), then rounds of one
request (a 128-token prompt of random tokens, then --decode-len greedy decode steps), each step
timed whole and split by timers around: the compiled layer loop (every decoder layer in one C++
call), the rest of the model's forward (embedding, first norm, RoPE lookup), the LM head
(compute_logits), the sampler, the batch's preparation, and the engine outside the runner
(scheduling, outputs). Per round, the mean ms of each part over its decode steps; then the weight
bytes a token reads (every layer's matmuls and the LM head) and the bound that reading them once at
the measured read bandwidth sets (`read_bandwidth`: torch's sum, the best of 4 KiB and huge pages).
The timers cost a few microseconds a step.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a GGUF file (default: the default model)")
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--decode-len", type=int, default=64)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from pagedserve import LLM, SamplingParams
    from pagedserve.bench.throughput import read_bandwidth
    from pagedserve.kernels import cpu, quant
    from pagedserve.models.loader import default_model_path
    from pagedserve.models.quantized import weight_nbytes
    model_path = args.model or default_model_path()
    llm = LLM(model_path, tokenizer=args.tokenizer, kv_cache_memory=512 * 1024**2, max_num_batched_tokens=2048,
              enable_prefix_caching=False)
    engine = llm.engine
    runner = engine.executor.worker.runner
    model = runner.model
    vocab = engine.model_args.vocab_size
    g = torch.Generator().manual_seed(0)
    prompt = lambda n: torch.randint(3, vocab, (n,), generator=g).tolist()   # noqa: E731
    llm.generate([{"prompt_token_ids": prompt(32)}], SamplingParams(max_tokens=4), use_tqdm=False)   # warm-up

    total: dict[str, float] = defaultdict(float)

    def wrap(obj, name: str, label: str) -> None:
        fn = getattr(obj, name)

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                total[label] += time.perf_counter() - t
        setattr(obj, name, timed)

    wrap(runner, "execute", "runner")
    wrap(runner, "_prepare", "prepare")
    wrap(model, "forward", "forward")
    wrap(model, "compute_logits", "lm_head")
    if model.compiled_layers is not None:
        wrap(model.compiled_layers, "forward", "layer_loop")
    sampler = runner.sampler

    class TimedSampler:
        def __call__(self, *a, **k):
            t = time.perf_counter()
            try:
                return sampler(*a, **k)
            finally:
                total["sampler"] += time.perf_counter() - t
    runner.sampler = TimedSampler()

    bandwidth = read_bandwidth()
    rounds = []
    for r in range(args.rounds):
        engine.add_request(f"d{r}", {"prompt_token_ids": prompt(128)},
                           SamplingParams(temperature=0, max_tokens=args.decode_len + 1, ignore_eos=True))
        engine.step()                    # the prefill and the first token
        total.clear()
        steps = []
        while engine.has_unfinished_requests():
            t = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t)
        n = len(steps)
        mean = {k: v / n * 1e3 for k, v in total.items()}
        step = sum(steps) / n * 1e3
        parts = dict(step=step, median_step=statistics.median(steps) * 1e3,
                     layer_loop=mean.get("layer_loop", 0.0),
                     forward_rest=mean.get("forward", 0.0) - mean.get("layer_loop", 0.0),
                     lm_head=mean.get("lm_head", 0.0), sampler=mean.get("sampler", 0.0),
                     prepare=mean.get("prepare", 0.0),
                     runner_rest=mean.get("runner", 0.0) - mean.get("forward", 0.0) - mean.get("lm_head", 0.0)
                     - mean.get("sampler", 0.0) - mean.get("prepare", 0.0),
                     engine_rest=step - mean.get("runner", 0.0))
        rounds.append(parts)
    bandwidth = max(bandwidth, read_bandwidth())
    layer_bytes = sum(weight_nbytes(getattr(w, n)) for w in model.layers for n in ("qkv", "o", "gate_up", "down"))
    head_bytes = weight_nbytes(model.lm_head)
    best = min(rounds, key=lambda p: p["step"])
    print(f"{model_path}: {(layer_bytes + head_bytes) / 1e6:.0f} MB of weights a token "
          f"(layers {layer_bytes / 1e6:.0f}, LM head {head_bytes / 1e6:.0f}); read bandwidth {bandwidth / 1e9:.1f} GB/s "
          f"({torch.get_num_threads()} threads, SIMD flags "
          f"{' '.join(sorted(f for f in cpu.cpu_flags() if f.startswith(('avx', 'amx', 'fma', 'f16c'))))})")
    keys = ["step", "median_step", "layer_loop", "forward_rest", "lm_head", "sampler", "prepare", "runner_rest",
            "engine_rest"]
    print(f"{'ms a step':<14}" + "".join(f"{k:>13}" for k in keys))
    for i, p in enumerate(rounds):
        print(f"{'round ' + str(i):<14}" + "".join(f"{p[k]:>13.3f}" for k in keys))
    print(f"best round: layer loop {layer_bytes / best['layer_loop'] / 1e6:.1f} GB/s of its weights, LM head "
          f"{head_bytes / best['lm_head'] / 1e6:.1f} GB/s; step {(layer_bytes + head_bytes) / bandwidth * 1e3:.2f} ms "
          f"bound -> {(layer_bytes + head_bytes) / bandwidth * 1e3 / best['step']:.0%} of it")
    result = dict(model=str(model_path), threads=torch.get_num_threads(), read_bytes_s=bandwidth,
                  layer_weight_bytes=layer_bytes, lm_head_bytes=head_bytes, decode_len=args.decode_len,
                  rounds=rounds, cpu_flags=sorted(cpu.cpu_flags() & {"avx2", "fma", "f16c", "avx512f", "avx512_vnni",
                                                                     "avx_vnni", "amx_int8"}),
                  cpu_kernels=cpu.describe(), quant_kernels=quant.describe())
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
        print(f"wrote {out}")
    llm.shutdown()


if __name__ == "__main__":
    main()
