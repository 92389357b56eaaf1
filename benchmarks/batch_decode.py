"""Decode batches of quantized GGUF files, end to end, beside llama.cpp's llama-batched-bench.

    .venv/bin/python benchmarks/batch_decode.py --work-dir DIR \\
        --llama-batched-bench .../llama.cpp/build/bin/llama-batched-bench [--files default Q4_0 Q4_K_M Q8_0]

For each file (the default model, SmolLM2-135M-Instruct Q4_1, and DIR's SmolLM2-1.7B-shaped
files made by llama.cpp's llama-quantize, `benchmarks/quantized.py --full --llama-quantize ...
--work-dir DIR`: smollm2-1.7b-shape-{Q4_0,Q4_K_M,Q8_0}-llama.gguf), in a child process of its own:
for each batch size B (--batch, default 4 and 16), B requests of --prompt-len random tokens arrive
together; the engine prefills them, then decodes --decode-len tokens each, all B rows in every
step (greedy sampling, the engine's whole step). Reported as llama-batched-bench reports it: S_PP
= B x prompt tokens / the prefill's seconds (the steps until every request has its first token,
which that prefill samples), S_TG = B x decode-len / the seconds of the decode steps after it
(each request asks for decode-len + 1 tokens: the prefill's token, then decode-len steps). The
best of --rounds rounds (the shared VM's speed drifts). The KV cache (2 GiB) holds every batch
whole, as llama-batched-bench's context does; "preempted" counts the rounds' preemptions (0
expected). llama-batched-bench runs on the same file in the same run: `-npp PROMPT -ntg DECODE
-npl 4,16 -t THREADS` (random tokens, no sampling).
Results: a table and benchmarks/results/batch_decode.json (--json).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
RESULTS = Path(__file__).resolve().parent / "results"
SHAPE_FILES = {m: f"smollm2-1.7b-shape-{m}-llama.gguf" for m in ("Q4_0", "Q4_K_M", "Q8_0")}


def run_child(spec: dict) -> dict:
    """Load one file and time its decode batches (the child's side)."""
    from pagedserve import LLM, SamplingParams
    batches, prompt_len, decode_len = spec["batches"], spec["prompt_len"], spec["decode_len"]
    # (a cache every batch fits in whole: at 512 MiB a 1.7B-shaped model's 16 x 193 tokens (196 KB a
    # token) did not, and the B = 16 rounds preempted and recomputed: slower than B = 4)
    llm = LLM(spec["model"], tokenizer=spec.get("tokenizer"), kv_cache_memory=2 * 1024**3,
              max_num_batched_tokens=max(2048, max(batches) * prompt_len), enable_prefix_caching=False)
    engine = llm.engine
    vocab = engine.model_args.vocab_size
    g = torch.Generator().manual_seed(0)
    prompt = lambda n: torch.randint(3, vocab, (n,), generator=g).tolist()   # noqa: E731
    llm.generate([{"prompt_token_ids": prompt(32)}], SamplingParams(max_tokens=4), use_tqdm=False)   # warm-up
    out = {}
    for B in batches:
        rounds = []
        for r in range(spec["rounds"]):
            for i in range(B):
                engine.add_request(f"b{B}-{r}-{i}", {"prompt_token_ids": prompt(prompt_len)},
                                   SamplingParams(temperature=0, max_tokens=decode_len + 1, ignore_eos=True))
            first: set[str] = set()
            preempted = engine.scheduler.stats.num_preemptions
            t0 = time.perf_counter()
            while len(first) < B:           # the prefill: until every request has its first token
                first.update(o.request_id for o in engine.step() if o.outputs and o.outputs[0].token_ids)
            t1 = time.perf_counter()
            steps = 0
            while engine.has_unfinished_requests():
                engine.step()
                steps += 1
            t2 = time.perf_counter()
            rounds.append(dict(t_pp=t1 - t0, t_tg=t2 - t1, decode_steps=steps,
                               preemptions=engine.scheduler.stats.num_preemptions - preempted))
        best_pp = min(r["t_pp"] for r in rounds)
        best_tg = min(r["t_tg"] for r in rounds)
        out[str(B)] = dict(rounds=rounds, speed_pp=B * prompt_len / best_pp, speed_tg=B * decode_len / best_tg)
    return out


def child(spec: dict, timeout: float) -> dict:
    res = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True,
                         timeout=timeout)
    if res.returncode:
        return {"error": res.stderr[-2000:]}
    return json.loads(res.stdout.strip().splitlines()[-1])


def llama_batched_bench(exe: str, path: str, threads: int, prompt_len: int, decode_len: int,
                        batches: list[int]) -> dict:
    """llama.cpp's llama-batched-bench on the same file: S_PP and S_TG per batch size."""
    cmd = [exe, "-m", path, "-t", str(threads), "-npp", str(prompt_len), "-ntg", str(decode_len),
           "-npl", ",".join(map(str, batches)), "-c", str(max(batches) * (prompt_len + decode_len) + 256),
           "--output-format", "jsonl"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if res.returncode:
        return {"error": res.stderr[-1000:]}
    out = {}
    for line in (res.stdout + "\n" + res.stderr).splitlines():
        if line.startswith("{") and '"speed_tg"' in line:
            row = json.loads(line)
            out[str(row["pl"])] = dict(speed_pp=row["speed_pp"], speed_tg=row["speed_tg"], t_pp=row["t_pp"],
                                       t_tg=row["t_tg"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work-dir", default=None, help="where the 1.7B-shaped -llama.gguf files are (with their "
                                                     "smollm2-1.7b-shape/ tokenizer folder)")
    ap.add_argument("--files", nargs="+", default=["default", *SHAPE_FILES], choices=["default", *SHAPE_FILES])
    ap.add_argument("--batch", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--decode-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--llama-batched-bench", default=None, help="path of llama.cpp's llama-batched-bench")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(run_child(json.loads(args.child))))
        return

    from pagedserve.kernels import cpu, quant
    from pagedserve.models.loader import default_model_path
    threads = torch.get_num_threads()
    runs = []
    for name in args.files:
        if name == "default":
            path, tokenizer, label = default_model_path(), None, "SmolLM2-135M Q4_1 (default)"
        else:
            if not args.work_dir:
                ap.error(f"--files {name} needs --work-dir")
            path = str(Path(args.work_dir) / SHAPE_FILES[name])
            tokenizer, label = str(Path(args.work_dir) / "smollm2-1.7b-shape"), f"1.7B shape {name}"
        print(f"  {label} ...", flush=True)
        spec = dict(model=path, tokenizer=tokenizer, batches=args.batch, prompt_len=args.prompt_len,
                    decode_len=args.decode_len, rounds=args.rounds)
        t0 = time.perf_counter()
        run = dict(file=label, path=path, pagedserve=child(spec, 1800))
        print(f"    pagedserve {time.perf_counter() - t0:.0f} s: " + json.dumps(
            {B: round(r["speed_tg"], 1) for B, r in run["pagedserve"].items() if B != "error"}), flush=True)
        if args.llama_batched_bench:
            t0 = time.perf_counter()
            run["llama_cpp"] = llama_batched_bench(args.llama_batched_bench, path, threads, args.prompt_len,
                                                   args.decode_len, args.batch)
            print(f"    llama.cpp {time.perf_counter() - t0:.0f} s: " + json.dumps(
                {B: round(r["speed_tg"], 1) for B, r in run["llama_cpp"].items() if B != "error"}), flush=True)
        runs.append(run)

    print(f"\n{'file':<30} {'B':>3} {'S_TG tok/s':>10} {'llama.cpp':>9} {'ratio':>6} {'S_PP tok/s':>10} "
          f"{'llama.cpp':>9} {'preempted':>9}")
    for run in runs:
        ours, theirs = run["pagedserve"], run.get("llama_cpp") or {}
        if "error" in ours:
            print(f"{run['file']:<30} error: {ours['error'].strip().splitlines()[-1]}")
            continue
        for B in map(str, args.batch):
            o, t = ours[B], theirs.get(B)
            ratio = f"{o['speed_tg'] / t['speed_tg']:.2f}x" if t else "-"
            print(f"{run['file']:<30} {B:>3} {o['speed_tg']:>10.1f} {t['speed_tg'] if t else 0:>9.1f} {ratio:>6} "
                  f"{o['speed_pp']:>10.1f} {t['speed_pp'] if t else 0:>9.1f} "
                  f"{sum(r['preemptions'] for r in o['rounds']):>9}")
    result = dict(threads=threads, prompt_len=args.prompt_len, decode_len=args.decode_len, batches=args.batch,
                  rounds=args.rounds, cpu_flags=sorted(cpu.cpu_flags() & {"avx2", "fma", "f16c", "avx512f",
                                                                           "avx512_vnni", "avx_vnni", "amx_int8"}),
                  runs=runs, cpu_kernels=cpu.describe(), quant_kernels=quant.describe())
    out = Path(args.json) if args.json else RESULTS / "batch_decode.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
