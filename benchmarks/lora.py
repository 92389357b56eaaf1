"""Multi-LoRA serving cost: the Alpaca-like workload over the base model and with 1, 4 and 16
distinct rank-16 adapters spread over the batch, in one engine and one run.

    .venv/bin/python benchmarks/lora.py            # the default model: 64 requests, 3 rounds
    .venv/bin/python benchmarks/lora.py --quick    # 16 requests, 1 round (< 3 min)
    .venv/bin/python benchmarks/lora.py --model PATH --dtype float32 --requests 8 --rounds 1
    .venv/bin/python benchmarks/lora.py --gguf-dequantize   # the default model's file as bf16 weights

The adapters are random PEFT directories the script writes (every projection targeted,
rank 16, small weights) over the model's shapes. Every configuration serves the same
requests (all at t=0, EOS ignored); the configurations alternate round by round and each
one's fastest round counts (machine noise only adds time). Reported per configuration:
steps, seconds per step and its ratio to the base model's (the cost of serving adapters,
goal < 1.15 with 4 adapters), output tok/s; and the ratio paired round by round (each round's
step time over the same round's base, run just before it: the machine's drift between rounds
cancels), its median and range over the rounds. "base, python loop" (only where the model has
the compiled CPU layer loop) is the base model with that loop off, for scale: with the
loop, steps with adapter rows (decodes and prefills alike) add their deltas inside it
(cpu_kernels.cpp lora_delta); without it (tensor parallelism, GPU) they take the Python
loop. "4 adapters, no handover" (compiled loop only) is the same with each delta on its own
after the quantized base product (kernels/cpu.py set_lora_handover(False)): what handing it to
that product saves (its adapter weights fetched while the product computes, one OpenMP meeting
a projection instead of two). Then time to first token of one
request whose adapter must first be read from disk, against the same adapter resident and
the base model: on an idle engine (the read is inline: nothing else waits), and arriving while
8 base-model requests decode (the read is ahead, in the background, beside a step; the longest
step meanwhile shows whether any step waited on the disk). Last (compiled CPU loop; not with
--no-profile) the delta alone per projection at the benchmark's decode batches, weights cold,
with the adapter bytes it reads and the rate: how far the delta is from the memory bound.
Writes benchmarks/results/lora.json.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.workloads import make_trace, trace_stats  # noqa: E402
from pagedserve import LLM, LoRARequest, SamplingParams  # noqa: E402
from pagedserve.kernels import cpu  # noqa: E402
from pagedserve.lora.adapter import PEFT_MODULES, part_shapes  # noqa: E402

RANK = 16


def write_adapter(path: Path, args, seed: int, rank: int = RANK) -> None:
    """A random PEFT LoRA adapter over every projection of every layer."""
    from safetensors.torch import save_file
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    shapes = part_shapes(args)
    tensors = {}
    for layer in range(args.num_layers):
        for module, part in PEFT_MODULES.items():
            fan_in, fan_out = shapes[part]
            block = "self_attn" if part in ("q", "k", "v", "o") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[prefix + ".lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * fan_in ** -0.5
            tensors[prefix + ".lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * 0.01
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": list(PEFT_MODULES),
        "lora_dropout": 0.0, "bias": "none", "task_type": "CAUSAL_LM"}))


def run(llm: LLM, trace, loras: list[LoRARequest | None]) -> tuple[float, int, int]:
    """Serve the trace, request i with loras[i % len]; returns (seconds, steps, output tokens)."""
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in trace]
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in trace]
    per_request = [loras[i % len(loras)] for i in range(len(trace))]
    steps = llm.engine.num_steps
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=per_request)
    seconds = time.perf_counter() - start
    return seconds, llm.engine.num_steps - steps, sum(len(o.outputs[0].token_ids) for o in outs)


def first_token_seconds(llm: LLM, prompt: list[int], lora: LoRARequest | None) -> float:
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False,
                 lora_request=lora)
    return time.perf_counter() - start


def first_token_under_load(llm: LLM, prompt: list[int], background: list[list[int]],
                           lora: LoRARequest | None) -> tuple[float, float, float]:
    """Time to first token of one request arriving while a batch of base-model requests decodes,
    and the longest and the median step from its arrival to its first token: with the read
    ahead (lora/slots.py), a cold adapter's files are read beside a step, not inside one."""
    engine = llm.engine
    for i, p in enumerate(background):
        engine.add_request(f"bg{i}", {"prompt_token_ids": p},
                           SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    for _ in range(3):          # the batch is running
        engine.step()
    start = time.perf_counter()
    engine.add_request("probe", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=1),
                       lora_request=lora)
    steps, done = [], False
    while not done:
        t = time.perf_counter()
        outs = engine.step()
        steps.append(time.perf_counter() - t)
        done = any(o.request_id == "probe" and o.outputs and o.outputs[0].token_ids for o in outs)
    ttft = time.perf_counter() - start
    while engine.has_unfinished_requests():
        engine.step()
    return ttft, max(steps), sorted(steps)[len(steps) // 2]


@torch.inference_mode()
def profile_delta(llm: LLM, loras: list[LoRARequest], cases: list[tuple[int, int]], repeats: int = 5) -> dict:
    """The compiled loop's LoRA delta alone (cpu.lora_delta, the kernel the loop calls) per
    projection for decode batches of `rows` rows over `n` adapters (rows spread round-robin),
    every layer, weights cold (a 256 MB sweep before each timing, as the base weights pass
    through the caches in a real step); minus the calls' own cost (the same calls with base rows
    only). Also the adapter bytes each projection reads per step and the rate that makes.
    Fills the first slots with the adapters directly: run last."""
    from pagedserve.batch import LoRALoad
    engine = llm.engine
    weights, args = engine.runner.lora, engine.model_args
    for slot, lora in enumerate(loras[:max(n for _, n in cases)]):
        weights.load(LoRALoad(slot, lora.lora_int_id, lora.lora_path))
    shapes = part_shapes(args)
    parts = {"qkv": ("q", "k", "v"), "o": ("o",), "gate_up": ("gate", "up"), "down": ("down",)}
    sweep = torch.empty(256 << 20, dtype=torch.uint8)
    out = {}
    for rows, n in cases:
        step = weights.step([i % n for i in range(rows)], [1] * rows)
        table = cpu.LoraTable(args.num_layers, step.compiled_key(), *step.compiled_weights())
        blocks, base_rows = step.row_blocks(), torch.full((rows,), -1, dtype=torch.long)
        per = {}
        for j, (module, names) in enumerate(parts.items()):
            fan_in, fan_out = shapes[names[0]][0], sum(shapes[p][1] for p in names)
            x = torch.randn(rows, fan_in).to(engine.dtype)
            y = torch.zeros(rows, fan_out, dtype=engine.dtype)

            def timed(row_block) -> float:
                best = float("inf")
                for _ in range(repeats):
                    sweep.fill_(1)
                    start = time.perf_counter()
                    for layer in range(args.num_layers):
                        cpu.lora_delta(table, layer, j, x, y, row_block)
                    best = min(best, time.perf_counter() - start)
                return best
            seconds = max(0.0, timed(blocks) - timed(base_rows))
            nbytes = n * args.num_layers * RANK * sum(shapes[p][0] + shapes[p][1] for p in names) * x.element_size()
            per[module] = {"ms": seconds * 1e3, "adapter_mb": nbytes / 1e6, "gb_s": nbytes / seconds / 1e9 if seconds else 0}
        total = sum(v["ms"] for v in per.values())
        mb = sum(v["adapter_mb"] for v in per.values())
        out[f"{rows} rows, {n} adapters"] = {"modules": per, "ms": total, "adapter_mb": mb}
        print(f"delta alone, {rows} rows over {n} adapters: " + "  ".join(
            f"{m} {v['ms']:.2f} ms" for m, v in per.items()) + f"  | {total:.2f} ms per step, {mb:.1f} MB of "
            f"adapter weights ({mb / total if total else 0:.1f} GB/s)", flush=True)
    return out


NO_HANDOVER = "4 adapters, no handover"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct (the bundled file)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--gguf-dequantize", action="store_true",
                    help="a .gguf model (the default one) dequantized to --dtype at load: the float base, whose "
                         "weights are 2.5x the Q4_1 file's bytes, where the adapters' share of a step's reads is smaller")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--adapters", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--quick", action="store_true", help="16 requests, 1 round")
    ap.add_argument("--no-profile", action="store_true",
                    help="skip the delta's per-projection times (compiled CPU loop only; about 20 s)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "lora.json"))
    a = ap.parse_args()
    if a.quick:
        a.requests, a.rounds = min(a.requests, 16), min(a.rounds, 1)
    most = max(a.adapters)
    llm = LLM(a.model, dtype=a.dtype, enable_lora=True, max_loras=most, max_lora_rank=RANK, max_cpu_loras=most + 1,
              enable_prefix_caching=False, gguf_dequantize=a.gguf_dequantize)
    engine = llm.engine
    args = engine.model_args
    trace = make_trace("alpaca", a.requests, seed=0, vocab_size=args.vocab_size, max_model_len=engine.max_model_len)
    tmp = Path(tempfile.mkdtemp(prefix="lora_bench_"))
    loras = []
    for i in range(most + 2):
        write_adapter(tmp / f"a{i}", args, seed=i)
        loras.append(LoRARequest(f"a{i}", i + 1, str(tmp / f"a{i}")))
    cold_busy = loras.pop()                # for the time to first token of an adapter not yet loaded:
    cold = loras.pop()                     # on an idle engine, and while a batch runs
    model = engine.runner.model
    compiled = getattr(model, "compiled_layers", None)
    configs = {"base": [None]}
    if compiled is not None:
        configs["base, python loop"] = [None]
    configs.update({f"{n} adapters": loras[:n] for n in a.adapters})
    if compiled is not None and 4 in a.adapters:
        configs[NO_HANDOVER] = loras[:4]

    def once(name: str) -> tuple[float, int, int]:
        model.compiled_layers = None if name == "base, python loop" else compiled
        cpu.set_lora_handover(name != NO_HANDOVER)
        try:
            return run(llm, trace, configs[name])
        finally:
            model.compiled_layers = compiled
            cpu.set_lora_handover(True)

    for name in configs:                    # warm-up: kernels, and every adapter read into its slot
        print(f"warm-up {name}: {once(name)[0]:.1f} s", flush=True)
    best: dict[str, tuple[float, int, int]] = {}
    per_round: dict[str, list[float]] = {name: [] for name in configs}       # seconds per step
    for i in range(a.rounds):
        for name in configs:
            r = once(name)
            print(f"round {i + 1} {name}: {r[0]:.2f} s, {r[1]} steps", flush=True)
            per_round[name].append(r[0] / r[1])
            if name not in best or r[0] < best[name][0]:
                best[name] = r
    base_step = best["base"][0] / best["base"][1]
    rows = {}
    print(f"{'config':<30} {'steps':>6} {'ms/step':>9} {'vs base':>8} {'out tok/s':>10}  paired by round: median (range)")
    for name, (seconds, steps, tokens) in best.items():
        per_step = seconds / steps
        paired = sorted(t / b for t, b in zip(per_round[name], per_round["base"]))
        rows[name] = {"seconds": seconds, "steps": steps, "output_tokens": tokens, "ms_per_step": per_step * 1e3,
                      "step_cost_ratio": per_step / base_step, "output_tok_s": tokens / seconds,
                      "paired_ratios": paired, "paired_ratio_median": paired[len(paired) // 2]}
        print(f"{name:<30} {steps:>6} {per_step * 1e3:>9.2f} {per_step / base_step:>8.3f} {tokens / seconds:>10.1f}"
              f"  {paired[len(paired) // 2]:.3f} ({paired[0]:.3f}-{paired[-1]:.3f})")
    prompt = trace[0].prompt_token_ids
    ttft = {"cold adapter (read from disk)": first_token_seconds(llm, prompt, cold),
            "same adapter, resident": first_token_seconds(llm, prompt, cold),
            "base": first_token_seconds(llm, prompt, None)}
    for name, s in ttft.items():
        print(f"TTFT {name}: {s * 1e3:.1f} ms")
    background = [r.prompt_token_ids for r in trace[1:9]]
    busy = {"cold adapter (read from disk)": first_token_under_load(llm, prompt, background, cold_busy),
            "same adapter, resident": first_token_under_load(llm, prompt, background, cold_busy),
            "base": first_token_under_load(llm, prompt, background, None)}
    for name, (s, longest, median) in busy.items():
        print(f"TTFT while 8 requests decode, {name}: {s * 1e3:.1f} ms (steps meanwhile: longest "
              f"{longest * 1e3:.1f} ms, median {median * 1e3:.1f} ms)")
    profile = {}
    if compiled is not None and not a.no_profile:
        cases = [(rows, n) for rows in sorted({min(16, a.requests), a.requests}) for n in a.adapters]
        profile = profile_delta(llm, loras, cases)
    result = {"model": a.model or "default", "dtype": str(engine.dtype), "gguf_dequantize": a.gguf_dequantize, "rank": RANK, "trace": trace_stats(trace),
              "rounds": a.rounds, "quick": a.quick, "configs": rows, "ttft_seconds": ttft,
              "ttft_under_load": {k: {"seconds": v[0], "longest_step_seconds": v[1], "median_step_seconds": v[2]}
                                  for k, v in busy.items()},
              "delta_profile": profile}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
