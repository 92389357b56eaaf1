"""Quantized weights: native GGUF blocks vs the dequantized bf16 path, on the CPU.

    .venv/bin/python benchmarks/quantized.py                 # default model + SmolLM2-1.7B-shaped files
    .venv/bin/python benchmarks/quantized.py --quick         # shorter runs, 1.7B shape cut to 4 layers (< 5 min)
    .venv/bin/python benchmarks/quantized.py --full --llama-bench ... --llama-quantize ...
                                        # all 24 layers, decode only, quantized files only (~10 min)
    .venv/bin/python benchmarks/quantized.py --llama-bench ~/llama.cpp/build/bin/llama-bench \
        --llama-quantize ~/llama.cpp/build/bin/llama-quantize    # files made by llama.cpp, and its speed on them
    .venv/bin/python benchmarks/quantized.py --full --full-prefill --shape qwen3-4b --mixes Q4_K_M --no-default-model \
        --llama-bench ... --llama-quantize ...   # issue 47's Qwen3-4B-shaped Q4_K_M (GGUF qwen3): decode and a
                                                 # 128-token prefill beside llama-bench (an 8 GB f16 made once)
    .venv/bin/python benchmarks/quantized.py --full --full-prefill --shape gemma3-1b --mixes Q4_K_M --no-default-model \
        --llama-bench ... --llama-quantize ...   # issue 48's Gemma 3 1B-shaped Q4_K_M (GGUF gemma3, a hybrid model)
                                                 # (--shape gemma3-4b: its 4B shape, an 8 GB f16 made once)

For the default model (SmolLM2-135M-Instruct, Q4_1) and a SmolLM2-1.7B-shaped model with random
weights, written here as GGUF files (Q4_0 and Q8_0 quantized by kernels/quant.py; a Q4_K_M-like mix
of random valid Q4_K / Q6_K blocks, since no K-quant quantizer is at hand), each configuration runs
in a child process of its own and reports: single-stream decode tok/s (rounds of a 128-token prompt,
then decode steps: the median of the rounds' median steps, and the best round's; 5 rounds with --full,
--decode-rounds sets it), prefill tok/s (one 512-token prompt, 128 with --quick), peak RSS while loading
(the child's VmHWM after the load less its RSS before it, the tokenizer already loaded; the table
shows it less the KV cache's bytes, which the JSON lists; a file's pages become resident as the
first steps read them, so "resident" is the RSS after the runs, less the same), and the bytes of weights each decode token
reads (every layer's matmuls and the LM head) against the bound that reading them once per token at
the read bandwidth measured right after that run's decode sets ("paired": the median round against a probe
right after that round: this host's bandwidth switches modes from minute to minute), and batch tok/s (--batch requests of 32-token prompts decoded
together: decode steps of that many rows, the dequantized tiles' path). The dequantized bf16 row of the 1.7B shape is the float model of the
same shape (load_format=dummy: the same compute as a dequantized file, without its float32 cache).
With --llama-bench, llama.cpp's llama-bench runs on the same files with the same threads (-p, -n as
ours; its build commit and number go into the JSON). With --llama-quantize, the 1.7B-shaped files are
what users download instead: an f16 GGUF of the shape is written once and llama.cpp's llama-quantize
makes each mix from it (real K-quant blocks, llama.cpp's own choice of type per tensor). Every file
carries the default model's tokenizer (the same 49152-token vocabulary), so llama.cpp can load it.
llama.cpp built with -DGGML_NATIVE=ON on a CPU with AMX (Sapphire Rapids) may crash in its AMX
matmul (seen: llama-bench segfaults in ggml_backend_amx_mul_mat); build it with -DGGML_NATIVE=OFF
and the CPU's flags named (-DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON
-DGGML_AVX_VNNI=ON ...; AMX off, as on the issue's Zen 4).
--full is the full-size decode row: all 24 layers of the 1.7B shape, the quantized files only
(default model Q4_1 and the 1.7B mixes; no float or dequantized runs), decode only (no prefill
timing; llama-bench with -p 0), 64 decode steps after the 128-token prompt (llama-bench's at -d
128): results in benchmarks/results/quantized_full.json.
--tiny runs a 2-layer 256-wide shape: it checks the script (and llama.cpp's tools) in seconds and
measures nothing. Results: a table, and benchmarks/results/quantized.json (quantized_quick.json
with --quick).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
RESULTS = Path(__file__).resolve().parent / "results"
# Every decode round's prompt (the child's): llama-bench decodes at this depth too (-d), the same
# workload (its decode at depth 0 reads less KV a token: ~3% of the weights' bytes at these shapes).
DECODE_PROMPT_LEN = 128

from tests.gguf_utils import finish, gemma_header, gemma_rename, gguf_name, gguf_writer, random_k_blocks  # noqa: E402

# SmolLM2-1.7B's config (HuggingFaceTB/SmolLM2-1.7B-Instruct's config.json).
SMOLLM2_1_7B = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu", torch_dtype="bfloat16",
                    hidden_size=2048, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=32,
                    num_key_value_heads=32, vocab_size=49152, max_position_embeddings=8192, rms_norm_eps=1e-5,
                    rope_theta=130000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)

# Qwen3-4B's config (Qwen/Qwen3-4B's config.json): issue 47's benchmark shape (--shape qwen3-4b).
QWEN3_4B = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_act="silu", torch_dtype="bfloat16",
                hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
                rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True, attention_bias=False,
                bos_token_id=151643, eos_token_id=151645)
# Gemma 3 1B's text config (google/gemma-3-1b-it's config.json): issue 48's benchmark shape (--shape gemma3-1b),
# a hybrid model: 26 layers, a 512-token window on five of every six, 1 KV head of 256, a 262144-token vocabulary.
GEMMA3_1B = dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", torch_dtype="bfloat16",
                 vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                 num_attention_heads=4, num_key_value_heads=1, head_dim=256, rms_norm_eps=1e-6,
                 rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, query_pre_attn_scalar=256,
                 sliding_window=512, max_position_embeddings=32768, hidden_activation="gelu_pytorch_tanh",
                 tie_word_embeddings=True, bos_token_id=2, eos_token_id=1)
# Gemma 3 4B's text config (google/gemma-3-4b-it's text_config): issue 48's larger shape (--shape gemma3-4b),
# 34 layers, a 1024-token window on five of every six, 4 KV heads of 256, a 262208-token vocabulary. (Its
# linear rope scaling of the global layers, factor 8, is left out: random weights, no effect on speed.)
GEMMA3_4B = dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", torch_dtype="bfloat16",
                 vocab_size=262208, hidden_size=2560, intermediate_size=10240, num_hidden_layers=34,
                 num_attention_heads=8, num_key_value_heads=4, head_dim=256, rms_norm_eps=1e-6,
                 rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, query_pre_attn_scalar=256,
                 sliding_window=1024, max_position_embeddings=131072, hidden_activation="gelu_pytorch_tanh",
                 tie_word_embeddings=True, bos_token_id=2, eos_token_id=1)
# --shape: (config, GGUF architecture, file stem, its name in the table)
SHAPES = {"smollm2-1.7b": (SMOLLM2_1_7B, "llama", "smollm2-1.7b-shape", "SmolLM2-1.7B"),
          "qwen3-4b": (QWEN3_4B, "qwen3", "qwen3-4b-shape", "Qwen3-4B"),
          "gemma3-1b": (GEMMA3_1B, "gemma3", "gemma3-1b-shape", "Gemma 3 1B"),
          "gemma3-4b": (GEMMA3_4B, "gemma3", "gemma3-4b-shape", "Gemma 3 4B")}

# GGML type of each tensor kind per file ("*": the rest), as llama.cpp's presets mix them.
MIXES = {"Q4_0": {"*": "Q4_0", "token_embd": "Q8_0"},
         "Q8_0": {"*": "Q8_0"},
         "Q4_K_M": {"*": "Q4_K", "attn_v": "Q6_K", "ffn_down": "Q6_K", "token_embd": "Q6_K"}}


# ---- writing GGUF files of a shape -----------------------------------------------------------

def _raw_blocks(ggml: str, w: torch.Tensor, rng: np.random.Generator) -> np.ndarray:
    """A float matrix as GGML blocks: f16 as it is, quantized where kernels/quant.py quantizes the
    type, random valid blocks of about the same spread for the K-quants."""
    import gguf

    from pagedserve.kernels import quant
    if ggml == "F16":
        return w.half().numpy()
    if ggml.lower() in quant.QUANTIZE_TYPES:
        return quant.quantize(w.float(), ggml.lower()).data.numpy()
    return random_k_blocks(gguf.GGMLQuantizationType[ggml], *w.shape, rng, std=float(w.float().std()),
                           sample_rows=64)


def copy_tokenizer(writer, source: str, vocab: int | None = None) -> None:
    """The tokenizer.ggml.* fields of GGUF file `source` into `writer` (llama.cpp loads no model
    without a vocabulary), its per-token arrays padded with unused tokens to `vocab` entries
    (a shape whose vocabulary is larger than the source's: llama.cpp wants one per row)."""
    import gguf
    reader = gguf.GGUFReader(source)
    pads = {"tokenizer.ggml.tokens": lambda i: f"<unused_{i}>", "tokenizer.ggml.token_type": lambda i: 5,
            "tokenizer.ggml.scores": lambda i: 0.0}      # (5: llama.cpp's UNUSED token type)
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer.ggml."):
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            values = list(field.contents())
            if name in pads and vocab:
                values += [pads[name](i) for i in range(len(values), vocab)]
            writer.add_array(name, values)
        else:
            writer.add_key_value(name, field.contents(), kind)


def write_gguf(config: dict, mix: dict, path: Path, seed: int = 0, tokenizer_from: str | None = None,
               arch: str = "llama") -> None:
    """A GGUF file of architecture `arch` (llama, qwen3, gemma3) of `config`'s shapes, random weights
    (std 0.02; norms 1; gemma3: its sandwich norms, q/k norms and window as llama.cpp's converter
    writes them), tensor by tensor in the mix's types (written to a temporary file as they are made:
    memory stays about one tensor, not the model); with the tokenizer of GGUF file `tokenizer_from`."""
    import gguf

    from pagedserve.models.dummy import DummyWeights
    from pagedserve.models.loader import args_from_hf_config
    args = args_from_hf_config(config)
    w = gguf_writer(path, arch, layers=args.num_layers, context=args.max_position_embeddings,
                    hidden=args.hidden_size, intermediate=args.intermediate_size, heads=args.num_heads,
                    kv_heads=args.num_kv_heads, eps=args.rms_norm_eps, vocab=args.vocab_size,
                    rope_theta=args.rope_theta, use_temp_file=True)
    gemma = arch == "gemma3"
    if gemma:
        gemma_header(w, args.head_dim, config["sliding_window"])
    elif args.head_dim != args.hidden_size // args.num_heads:
        w.add_key_length(args.head_dim)
        w.add_value_length(args.head_dim)
    if tokenizer_from:
        copy_tokenizer(w, tokenizer_from, args.vocab_size)
    weights = DummyWeights(args, torch.float32, "cpu", seed)
    rng = np.random.default_rng(seed)
    for name in weights:
        t = weights[name]
        if t.dim() == 1:
            renamed = gemma_rename(name, t.numpy()) if gemma else None
            w.add_tensor(*(renamed[0] if renamed else (gguf_name(name)[1], t.numpy())))
            continue
        kind, name_in_file = gguf_name(name)
        ggml = mix.get(kind, mix["*"])          # (random weights: q/k need no rotary permutation)
        w.add_tensor(name_in_file, _raw_blocks(ggml, t, rng), raw_dtype=gguf.GGMLQuantizationType[ggml])
    finish(w)


# ---- one configuration, in a child process ---------------------------------------------------

def _status(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    return 0


class _RssSampler:
    """VmRSS every `every` s in a thread while a load runs ([seconds, bytes] pairs): where the
    peak (VmHWM) falls and what the load holds on its way (the thread waits for the GIL while
    a kernel holds it; VmHWM is the peak itself)."""

    def __init__(self, every: float = 0.5) -> None:
        import threading
        self.samples: list = []
        self._done = threading.Event()
        self._start = time.perf_counter()
        self._thread = threading.Thread(target=self._run, args=(every,), daemon=True)
        self._thread.start()

    def _run(self, every: float) -> None:
        while not self._done.wait(every):
            self.samples.append([round(time.perf_counter() - self._start, 2), _status("VmRSS:")])

    def stop(self) -> list:
        self._done.set()
        self._thread.join()
        return self.samples


def run_child(spec: dict) -> dict:
    """Load one configuration and time it (the child's side)."""
    from pagedserve.bench.throughput import decode_step_times, read_bandwidth
    from pagedserve import LLM, SamplingParams
    from pagedserve.models.loader import load_tokenizer
    from pagedserve.models.quantized import model_weight_bytes, weight_nbytes
    from pagedserve.kernels import quant
    # The tokenizer first (a GGUF's is built once, then cached on disk), then the peak is reset:
    # the load's peak is the model's.
    load_tokenizer(spec.get("tokenizer") or spec["model"], stand_in=spec.get("load_format") == "dummy")
    import gc
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")                    # resets VmHWM to the current RSS (Linux 4.0+)
    rss_before = _status("VmRSS:")
    samples = _RssSampler() if spec.get("sample_rss") else None
    start = time.perf_counter()
    llm = LLM(spec["model"], tokenizer=spec.get("tokenizer"), dtype=spec.get("dtype", "auto"),
              gguf_dequantize=spec.get("gguf_dequantize", False), load_format=spec.get("load_format", "auto"),
              quantization=spec.get("quantization"), kv_cache_memory=spec.get("kv_cache_memory", 128 * 1024**2),
              max_num_batched_tokens=max(2048, spec["prefill_len"]), enable_prefix_caching=False)
    load_s = time.perf_counter() - start
    peak_load = _status("VmHWM:")
    rss_load = samples.stop() if samples else None
    rss_parts = {k: _status(k + ":") for k in ("RssAnon", "RssFile")}
    runner = llm.engine.executor.worker.runner
    model = runner.model
    if spec.get("python_loop"):         # the Python layer loop over the same kernels (a comparison)
        model.compiled_layers = None
    kv_bytes = runner.kv_cache.numel() * runner.kv_cache.element_size()
    per_token = sum(weight_nbytes(getattr(w, n)) for w in model.layers for n in ("qkv", "o", "gate_up", "down")) + \
        weight_nbytes(model.lm_head)
    if llm.engine.model_args.moe is not None:       # (benchmarks/moe.py) the router and k experts a token reads
        from pagedserve.models.quantized import model_read_bytes_per_token
        per_token = model_read_bytes_per_token(model)
    engine = llm.engine
    vocab = llm.engine.model_args.vocab_size
    g = torch.Generator().manual_seed(0)
    prompt = lambda n: torch.randint(3, vocab, (n,), generator=g).tolist()   # noqa: E731
    llm.generate([{"prompt_token_ids": prompt(32)}], SamplingParams(max_tokens=4), use_tqdm=False)   # warm-up
    # Prefill: one prompt, one step (the first token's sampling included).
    prefills = []                       # none with --full (repeats 0): decode only
    for i in range(spec["repeats"]):
        engine.add_request(f"p{i}", {"prompt_token_ids": prompt(spec["prefill_len"])},
                           SamplingParams(temperature=spec.get("prefill_temperature", 0.0), max_tokens=1))
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        prefills.append(time.perf_counter() - t0)
    # Decode: rounds of one request each (a 128-token prompt, then decode_len steps), each
    # round's median step; the VM's speed drifts over seconds (a round's median moved 3.7-5.5 ms
    # within one process at the 135M shape), so several rounds, reported as their median and best.
    # With paired_probe each round is followed by a read probe (512 MiB, best of 3), and the round's
    # share of the bound is taken against its own probe: this host's bandwidth switches between
    # ~35 and ~60 GB/s from minute to minute, so one probe after all rounds can land in the other mode.
    rounds, probes = [], []
    for i in range(spec.get("decode_rounds", 1)):
        engine.add_request(f"d{i}", {"prompt_token_ids": prompt(DECODE_PROMPT_LEN)},
                           SamplingParams(temperature=0, max_tokens=spec["decode_len"], ignore_eos=True))
        steps = sorted(decode_step_times(engine))
        rounds.append(steps[len(steps) // 2])
        if spec.get("paired_probe"):
            probes.append(read_bandwidth(1 << 29, repeats=3))
    median, best = sorted(rounds)[len(rounds) // 2], min(rounds)
    paired = sorted(per_token / r / p for r, p in zip(rounds, probes))
    # Batch throughput: `batch` requests at once (short prompts, decode_len tokens each): decode
    # steps of that many rows, which take the dequantized tiles (over AMX where the CPU has it:
    # with the weights as AMX A tiles for bf16 x of 8-384 rows, quant.amxw_in_use()).
    batch_tok_s = None
    if spec.get("batch"):
        for i in range(spec["batch"]):
            engine.add_request(f"b{i}", {"prompt_token_ids": prompt(32)},
                               SamplingParams(temperature=0, max_tokens=spec["decode_len"], ignore_eos=True))
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        batch_tok_s = spec["batch"] * spec["decode_len"] / (time.perf_counter() - t0)
    return dict(load_s=load_s, rss_before_load=rss_before, peak_rss_load=peak_load, rss_after=_status("VmRSS:"),
                rss_while_loading=rss_load, rss_after_load_parts=rss_parts,
                kv_cache_bytes=kv_bytes,
                weight_bytes=model_weight_bytes(model), bytes_per_token=per_token,
                decode_tok_s=1 / median, decode_ms=median * 1e3, decode_best_tok_s=1 / best,
                decode_round_ms=[r * 1e3 for r in rounds],
                decode_round_read_bytes_s=probes,
                paired_fraction_of_bound=paired[len(paired) // 2] if paired else None,
                prefill_tok_s=spec["prefill_len"] / min(prefills) if prefills else None,
                prefill_median_tok_s=spec["prefill_len"] / sorted(prefills)[len(prefills) // 2] if prefills else None,
                prefill_round_ms=[t * 1e3 for t in prefills],
                batch=spec.get("batch"), batch_tok_s=batch_tok_s, compiled_loop=model.compiled_layers is not None,
                quant_kernels=quant.variant())      # the variant this child ran (a JSON's label can be wrong)


def child(spec: dict, timeout: float, env: dict[str, str] | None = None, tree: str | None = None) -> dict:
    """run_child's result in a fresh process ({"error": ...} where it failed); env: variables set
    for it (benchmarks/variant_ab.py's forced quant variant); tree: another checkout whose copy of
    this script runs it (and so its pagedserve and kernel sources: variant_ab.py's VARIANT@TREE)."""
    env = dict(env or {})
    # The dequantized path writes a float32 copy of the file into the cache: a scratch cache for
    # it (its kernels compile there once, before the timed part); the others use the user's cache.
    if spec.get("gguf_dequantize"):
        env["PAGEDSERVE_CACHE"] = spec["cache"]
    script = str(Path(tree) / "benchmarks" / Path(__file__).name) if tree else __file__
    res = subprocess.run([sys.executable, script, "--child", json.dumps(spec)], capture_output=True, text=True,
                         timeout=timeout, env={**os.environ, **env})
    if res.returncode:
        return {"error": res.stderr[-2000:]}
    return json.loads(res.stdout.strip().splitlines()[-1])


def llama_bench(exe: str, path: str, threads: int, prefill: int, decode: int, max_rss: bool = False,
                repetitions: int | None = None, depth: int = DECODE_PROMPT_LEN) -> dict:
    """llama.cpp's llama-bench on the same file: prefill (-p, from an empty context) and decode (-n, after
    `depth` tokens of context: -d) tok/s (their mean and each repetition's: `*_rounds_tok_s`; prefill 0:
    decode alone); with max_rss its peak resident memory too (GNU time's -v: the process's VmHWM, its
    mapped file pages included; the larger of its runs)."""
    timer = ["/usr/bin/time", "-v"] if max_rss else []
    reps = ["-r", str(repetitions)] if repetitions else []
    # -d applies to every test of a run: a prefill from an empty context is a run of its own
    tests = ([["-p", str(prefill), "-n", "0"]] if prefill else []) + \
        ([["-p", "0", "-n", str(decode), "-d", str(depth)]] if decode else [])
    out = {}
    for test in tests:
        res = subprocess.run([*timer, exe, "-m", path, "-t", str(threads), *test, *reps, "-o", "json"],
                             capture_output=True, text=True, timeout=1800)
        if res.returncode:
            return {"error": res.stderr[-1000:]}
        for line in res.stderr.splitlines() if max_rss else ():
            if "Maximum resident set size (kbytes):" in line:
                out["max_rss_bytes"] = max(out.get("max_rss_bytes", 0), int(line.rsplit(":", 1)[1]) * 1024)
        for row in json.loads(res.stdout):
            key = "prefill_tok_s" if row.get("n_prompt") else "decode_tok_s"
            out[key] = row.get("avg_ts")
            out[key.replace("tok_s", "rounds_tok_s")] = row.get("samples_ts")      # each repetition's
            out.update(build_commit=row.get("build_commit"), build_number=row.get("build_number"),
                       cpu_info=row.get("cpu_info"), backends=row.get("backends"))
            if not row.get("n_prompt"):
                out["decode_depth"] = row.get("n_depth", 0)
    return out


def llama_quantize(exe: str, source: Path, path: Path, ftype: str, threads: int,
                   allow_requantize: bool = False) -> None:
    """llama.cpp's llama-quantize: GGUF `source` (f16, or a quantized file with allow_requantize)
    as `ftype` (Q4_0, Q8_0, Q4_K_M, ...) at `path`."""
    flags = ["--allow-requantize"] if allow_requantize else []
    res = subprocess.run([exe, *flags, str(source), str(path), ftype, str(threads)], capture_output=True, text=True,
                         timeout=3600)
    if res.returncode:
        raise RuntimeError(f"llama-quantize {ftype} failed: {res.stderr[-2000:]}")


# ---- the run ---------------------------------------------------------------------------------

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="short runs, the 1.7B shape cut to 4 layers (< 5 min)")
    ap.add_argument("--full", action="store_true", help="full size, decode only: all 24 layers of the 1.7B shape, "
                                                       "the quantized files only (~10 min)")
    ap.add_argument("--layers", type=int, default=None, help="layers of the 1.7B shape (default: 24; 4 with --quick)")
    ap.add_argument("--full-prefill", action="store_true", help="with --full: also one 128-token prefill timed "
                    "(and llama-bench -p 128)")
    ap.add_argument("--prefill-rounds", type=int, default=1, help="with --full-prefill: this many timed "
                    "128-token prefills (the table: the best; below it and in the JSON: the median)")
    ap.add_argument("--shape", default="smollm2-1.7b", choices=list(SHAPES),
                    help="the random-weight shape of the quantized files (qwen3-4b: issue 47's, GGUF qwen3)")
    ap.add_argument("--mixes", nargs="+", default=list(MIXES), choices=list(MIXES))
    ap.add_argument("--no-default-model", action="store_true")
    ap.add_argument("--llama-bench", default=None, help="path of llama.cpp's llama-bench: run it on the same files")
    ap.add_argument("--llama-quantize", default=None, help="path of llama.cpp's llama-quantize: make the 1.7B-shaped "
                                                          "files with it from an f16 file of the shape")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer 256-wide shape: checks the script, measures nothing")
    ap.add_argument("--work-dir", default=None, help="where the GGUF files are written (default: a temporary dir, "
                                                     "removed after)")
    ap.add_argument("--decode-rounds", type=int, default=None, help="single-stream decode rounds per configuration "
                                                                    "(default: 5 with --full, else 1)")
    ap.add_argument("--batch", type=int, default=48, help="requests decoded at once for the batch throughput "
                                                         "column (0: skip it)")
    ap.add_argument("--prefill-temperature", type=float, default=0.0,
                    help="the timed prefill's sampling temperature (0: greedy, a batch-invariant step under the "
                         "engine's default; > 0: a plain step)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(run_child(json.loads(args.child))))
        return

    from pagedserve.bench.throughput import read_bandwidth
    from pagedserve.kernels import cpu, quant
    from pagedserve.models.dummy import stand_in_tokenizer
    from pagedserve.models.loader import default_model_path
    threads = torch.get_num_threads()
    if args.full and args.quick:
        ap.error("--full and --quick are exclusive")
    shape, arch, stem, shape_name = SHAPES[args.shape]
    layers = args.layers or (4 if args.quick else shape["num_hidden_layers"])
    # --full: decode only (repeats 0: no prefill timing), 64 steps
    full_repeats = args.prefill_rounds * int(args.full_prefill)
    prefill_len, decode_len, repeats = (128, 16, 1) if args.quick else (128, 64, full_repeats) if args.full \
        else (512, 128, 3)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="pagedserve-quantized-"))
    work.mkdir(parents=True, exist_ok=True)
    cache = str(work / "cache")
    print(f"{threads} threads; measuring read bandwidth ...", flush=True)
    bandwidth = read_bandwidth(1 << 28 if args.quick else 1 << 30)
    batch = 0 if args.full else args.batch      # --full: single-stream decode only
    decode_rounds = args.decode_rounds or (5 if args.full else 1)
    base = dict(cache=cache, prefill_len=prefill_len, decode_len=decode_len, repeats=repeats, batch=batch,
                decode_rounds=decode_rounds, prefill_temperature=args.prefill_temperature, paired_probe=True,
                kv_cache_memory=(256 if batch else 128) * 1024**2)
    runs: list[dict] = []
    timeout = 600 if args.quick else 3600

    def run(label: str, model_file: str, spec: dict, gguf_file: str | None) -> None:
        print(f"  {label} ...", flush=True)
        result = {"model": model_file, "config": label, **child({**base, **spec}, timeout)}
        # The host's bandwidth moves minute to minute: each run's bound is probed right after its decode.
        result["read_bytes_s"] = read_bandwidth(1 << 28 if args.quick else 1 << 30)
        if gguf_file and args.llama_bench:
            result["llama_bench"] = llama_bench(args.llama_bench, gguf_file, threads,
                                                0 if args.full and not args.full_prefill else prefill_len, decode_len)
        runs.append(result)

    try:
        if not args.no_default_model:
            path = default_model_path()
            run("Q4_1 native", "SmolLM2-135M-Instruct", dict(model=path), path)
            if not args.full:
                run("bf16 dequantized", "SmolLM2-135M-Instruct", dict(model=path, gguf_dequantize=True,
                                                                       dtype="bfloat16"), None)
        config = {**shape, "num_hidden_layers": layers}
        if args.tiny:
            config.update(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=4)
            layers = 2
        tokenizer_from = default_model_path()      # its vocabulary is SmolLM2-1.7B's
        shape_dir = work / stem
        shape_dir.mkdir(exist_ok=True)
        (shape_dir / "config.json").write_text(json.dumps(config))
        stand_in_tokenizer(config).save_pretrained(str(shape_dir))
        name = f"{shape_name} shape ({layers} layers)" \
            if not args.tiny else "tiny shape (2 layers, 256 wide)"
        maker = "llama-quantize" if args.llama_quantize else "benchmarks/quantized.py"
        f16 = work / f"{stem}-F16.gguf"
        for mix in args.mixes:
            path = work / f"{stem}-{mix}{'-llama' if args.llama_quantize else ''}.gguf"
            if not path.exists():
                if args.llama_quantize:
                    if not f16.exists():
                        print(f"  writing {f16.name} ...", flush=True)
                        write_gguf(config, {"*": "F16"}, f16, tokenizer_from=tokenizer_from, arch=arch)
                    print(f"  llama-quantize {mix} ...", flush=True)
                    llama_quantize(args.llama_quantize, f16, path, mix, threads)
                else:
                    print(f"  writing {path.name} ...", flush=True)
                    write_gguf(config, MIXES[mix], path, tokenizer_from=tokenizer_from, arch=arch)
            run(f"{mix} native", name, dict(model=str(path), tokenizer=str(shape_dir)), str(path))
            runs[-1].update(file_bytes=path.stat().st_size, file_made_by=maker)
        if not args.full:
            run("bf16 (float, same shape)", name, dict(model=str(shape_dir), load_format="dummy", dtype="bfloat16"),
                None)
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)

    for r in runs:
        if "bytes_per_token" in r:
            r["bound_tok_s"] = r["read_bytes_s"] / r["bytes_per_token"]
            r["fraction_of_bound"] = r["decode_tok_s"] / r["bound_tok_s"]
            r["best_fraction_of_bound"] = r["decode_best_tok_s"] / r["bound_tok_s"]
    ran = sorted({r["quant_kernels"] or "torch" for r in runs if "quant_kernels" in r})
    print(f"\nquant kernels the runs used: {', '.join(ran) or '-'}")
    print(f"\n{'model':<34} {'weights':<26} {'decode tok/s':>12} {'bound':>7} {'best':>5} {'paired':>6} {'prefill tok/s':>13} "
          f"{'peak load MiB':>13} {'resident MiB':>12} {'weights MiB':>11} {'llama.cpp tg/pp':>16} {'batch tok/s':>11}")
    for r in runs:
        if "error" in r:
            print(f"{r['model']:<34} {r['config']:<26} error: {r['error'].strip().splitlines()[-1]}")
            continue
        lb = r.get("llama_bench") or {}
        lbs = f"{lb.get('decode_tok_s', 0):.1f}/{lb.get('prefill_tok_s') or 0:.0f}" if "decode_tok_s" in lb else \
            "error (see JSON)" if "error" in lb else "-"
        print(f"{r['model']:<34} {r['config']:<26} {r['decode_tok_s']:>12.1f} {r['fraction_of_bound']:>6.0%} "
              f"{r['best_fraction_of_bound']:>5.0%} {r.get('paired_fraction_of_bound') or 0:>6.0%} "
              f"{r['prefill_tok_s'] or 0:>13.0f} {(r['peak_rss_load'] - r['rss_before_load'] - r['kv_cache_bytes']) / 2**20:>13.0f} "
              f"{(r['rss_after'] - r['rss_before_load'] - r['kv_cache_bytes']) / 2**20:>12.0f} "
              f"{r['weight_bytes'] / 2**20:>11.0f} {lbs:>16} {r.get('batch_tok_s') or 0:>11.1f}")
    for r in runs:
        lb_pp = (r.get("llama_bench") or {}).get("prefill_tok_s")
        if r.get("prefill_median_tok_s") and lb_pp:       # the median of ours against llama-bench's mean
            print(f"{r['model']} {r['config']}: prefill median {r['prefill_median_tok_s']:.1f} tok/s over "
                  f"{len(r['prefill_round_ms'])} rounds (best {r['prefill_tok_s']:.1f}), llama.cpp {lb_pp:.1f} "
                  f"(mean of its repetitions): {r['prefill_median_tok_s'] / lb_pp:.2f}x")
    result = dict(threads=threads, read_bytes_s=bandwidth, shape=args.shape, quick=args.quick, full=args.full,
                  tiny=args.tiny,
                  layers_of_1_7b_shape=layers,
                  prefill_len=prefill_len, prefill_temperature=args.prefill_temperature,
                  decode_prompt_len=DECODE_PROMPT_LEN,
                  decode_len=decode_len, decode_rounds=decode_rounds,
                  runs=runs,
                  cpu_kernels=cpu.describe(), quant_kernels=quant.describe())
    if args.tiny and not args.json:
        return                   # a check of the script: no results file
    out = Path(args.json) if args.json else \
        RESULTS / ("quantized_quick.json" if args.quick else "quantized_full.json" if args.full else "quantized.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
