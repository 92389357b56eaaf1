"""gpt-oss on the CPU with its experts in MXFP4: a random-weight gpt-oss-20b-shaped model, whole (24
layers) or cut to a few (hidden 2880, 64 query heads and 8 KV heads of 64, 32 experts of FFN width
2880, 4 per token, a 128-token window on alternating layers, sinks, YaRN; gpt-oss-20b's 201088-token
vocabulary: the default model's tokenizer padded with unused tokens, so that llama.cpp loads the file).

    .venv/bin/python benchmarks/gpt_oss.py --layers 24 --gguf-only --work-dir DIR --llama-bench /path/to/llama-bench
    .venv/bin/python benchmarks/gpt_oss.py --layers 2 --vocab 49152 --llama-bench ...   # the first runs' cut
    .venv/bin/python benchmarks/gpt_oss.py --tiny          # a narrow shape: checks the script

Two measurements, each in a child process:
- loading an HF checkpoint whose experts are MXFP4 (`*_blocks`, `*_scales`), bf16 elsewhere: the
  peak resident memory of the load (VmHWM, reset first) and what stays, with the experts kept in
  MXFP4 (now) against dequantized to bf16 at load (before: the same code with the builder told
  not to keep them);
- a llama.cpp-layout `gpt-oss` GGUF file (experts MXFP4, attention and embeddings Q8_0; written
  tensor by tensor, ~12 GB at full size, memory about one expert stack): load time, the peak
  resident memory while loading (VmHWM, and VmRSS sampled through the load) and after, single-stream
  decode tok/s, prefill tok/s (benchmarks/quantized.py's child), and with --llama-bench llama.cpp's
  llama-bench on the same file and threads (its peak RSS by GNU time).
Results: a table, and benchmarks/results/gpt_oss.json. Measure only through /work/bin/timed.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
RESULTS = Path(__file__).resolve().parent / "results"

from benchmarks.moe import _random_blocks  # noqa: E402
from benchmarks.quantized import child, copy_tokenizer, llama_bench  # noqa: E402
from tests.gguf_utils import gguf_writer, write_streamed  # noqa: E402

# openai/gpt-oss-20b's config.json (layers cut by --layers, the vocabulary by --vocab)
GPT_OSS_20B = dict(architectures=["GptOssForCausalLM"], model_type="gpt_oss", hidden_size=2880, intermediate_size=2880,
                   num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                   num_local_experts=32, num_experts_per_tok=4, vocab_size=201088, max_position_embeddings=131072,
                   rms_norm_eps=1e-5, sliding_window=128, tie_word_embeddings=False, attention_bias=True,
                   swiglu_limit=7.0, bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16",
                   rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                 "truncate": False, "original_max_position_embeddings": 4096}, rope_theta=150000.0)
SCALES = (117, 122)        # E8M0 bytes: values up to 6 x 2^-5.. 2^-10 (weights of std ~0.02)


def _shapes(config: dict) -> tuple[int, int, int, int, int]:
    h, f, e = config["hidden_size"], config["intermediate_size"], config["num_local_experts"]
    return h, f, e, config["num_attention_heads"] * config["head_dim"], config["num_key_value_heads"] * config["head_dim"]


def _mxfp4_gguf(shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    *lead, cols = shape
    raw = rng.integers(0, 256, size=(*lead, cols // 32, 17), dtype=np.uint8)
    raw[..., 0] = rng.integers(*SCALES, size=raw.shape[:-1], dtype=np.uint8)
    return raw.reshape(*lead, cols // 32 * 17)


def _file_name(config: dict) -> str:
    """The suffix of the shape's files in the work directory (the 2-layer, 49152-token shape of the
    first runs: none, its files keep their names)."""
    layers, vocab = config["num_hidden_layers"], config["vocab_size"]
    return "" if (layers, vocab) == (2, 49152) else f"-{layers}l-vocab{vocab}"


def _gguf_tensors(config: dict, rng: np.random.Generator) -> list:
    """The file's tensors as write_streamed takes them: (name, shape, dtype, GGML type, make), each
    made only when written, in this order (one generator: the bytes do not depend on how they are
    written)."""
    import gguf
    h, f, e, q, kv = _shapes(config)
    q8, mx = gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.MXFP4
    q8_bytes = lambda rows, cols: (rows, cols // 32 * 34)           # noqa: E731

    def q8_0(rows: int, cols: int) -> tuple:
        return q8_bytes(rows, cols), np.uint8, q8, lambda: _random_blocks("Q8_0", (rows, cols), rng)

    def small(*shape: int) -> tuple:
        return shape, np.float32, None, lambda: rng.normal(0, 0.02, size=shape).astype(np.float32)

    def ones(n: int) -> tuple:
        return (n,), np.float32, None, lambda: np.ones(n, np.float32)

    def mxfp4(shape: tuple[int, int, int]) -> tuple:
        return (*shape[:2], shape[2] // 32 * 17), np.uint8, mx, lambda: _mxfp4_gguf(shape, rng)

    out = [("token_embd.weight", *q8_0(config["vocab_size"], h)), ("output_norm.weight", *ones(h)),
           ("output.weight", *q8_0(config["vocab_size"], h))]
    for i in range(config["num_hidden_layers"]):
        p = f"blk.{i}."
        for kind, rows in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
            out += [(p + kind + ".weight", *q8_0(rows, h)), (p + kind + ".bias", *small(rows))]
        out += [(p + "attn_output.weight", *q8_0(h, q)), (p + "attn_output.bias", *small(h)),
                (p + "attn_sinks.weight", *small(config["num_attention_heads"])),
                (p + "attn_norm.weight", *ones(h)), (p + "post_attention_norm.weight", *ones(h)),
                (p + "ffn_gate_inp.weight", *small(e, h)), (p + "ffn_gate_inp.bias", *small(e))]
        for kind, shape in (("ffn_gate_exps", (e, f, h)), ("ffn_up_exps", (e, f, h)), ("ffn_down_exps", (e, h, f))):
            out += [(p + kind + ".weight", *mxfp4(shape)), (p + kind + ".bias", *small(e, shape[1]))]
    return out


def write_gguf(config: dict, path: Path, tokenizer_from: str, seed: int = 0) -> None:
    """A `gpt-oss` file as llama.cpp's converter lays it out, each tensor made as it is written
    (memory about one expert stack, 141 MB at full size; no temporary copy of the file); the
    tokenizer of GGUF file `tokenizer_from`, padded with unused tokens to the shape's vocabulary."""
    import gguf
    h, f, e, q, kv = _shapes(config)
    rope = config["rope_scaling"]
    w = gguf_writer(path, "gpt-oss", layers=config["num_hidden_layers"], context=config["max_position_embeddings"],
                    hidden=h, intermediate=f, heads=config["num_attention_heads"], kv_heads=config["num_key_value_heads"],
                    eps=config["rms_norm_eps"], vocab=config["vocab_size"], rope_theta=config["rope_theta"])
    w.add_key_length(config["head_dim"])
    w.add_value_length(config["head_dim"])
    w.add_expert_count(e)
    w.add_expert_used_count(config["num_experts_per_tok"])
    w.add_expert_feed_forward_length(f)
    w.add_sliding_window(config["sliding_window"])
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    copy_tokenizer(w, tokenizer_from, config["vocab_size"])
    write_streamed(w, _gguf_tensors(config, np.random.default_rng(seed)))


def write_hf(config: dict, root: Path, seed: int = 0) -> None:
    """An HF directory of the shape: experts MXFP4 (`*_blocks` [E, out, in / 32, 16], `*_scales`), the
    rest bf16, one safetensors file per layer (written one at a time: memory about one layer)."""
    from safetensors.torch import save_file

    from pagedserve.models.dummy import stand_in_tokenizer
    h, f, e, q, kv = _shapes(config)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config))
    stand_in_tokenizer(config).save_pretrained(str(root))
    g = torch.Generator().manual_seed(seed)
    bf = lambda *s: (torch.randn(*s, generator=g) * 0.02).to(torch.bfloat16)     # noqa: E731

    def mx(name: str, out: int, cols: int) -> dict:
        return {name + "_blocks": torch.randint(0, 256, (e, out, cols // 32, 16), dtype=torch.uint8, generator=g),
                name + "_scales": torch.randint(*SCALES, (e, out, cols // 32), dtype=torch.uint8, generator=g)}

    save_file({"model.embed_tokens.weight": bf(config["vocab_size"], h), "lm_head.weight": bf(config["vocab_size"], h),
               "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}, str(root / "model-top.safetensors"))
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t = {p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
             p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
             p + "self_attn.sinks": bf(config["num_attention_heads"]),
             p + "mlp.router.weight": bf(e, h), p + "mlp.router.bias": bf(e),
             p + "mlp.experts.gate_up_proj_bias": bf(e, 2 * f), p + "mlp.experts.down_proj_bias": bf(e, h),
             **mx(p + "mlp.experts.gate_up_proj", 2 * f, h), **mx(p + "mlp.experts.down_proj", h, f)}
        for n, rows, cols in (("q_proj", q, h), ("k_proj", kv, h), ("v_proj", kv, h), ("o_proj", h, q)):
            t[p + f"self_attn.{n}.weight"], t[p + f"self_attn.{n}.bias"] = bf(rows, cols), bf(rows)
        save_file(t, str(root / f"model-{i:05d}.safetensors"))


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def load_child(spec: dict) -> dict:
    """Load the HF directory (experts kept in MXFP4, or dequantized as before) and report memory."""
    import time

    from pagedserve import LLM
    from pagedserve.models import moe_weights
    from pagedserve.models.loader import load_tokenizer
    from pagedserve.models.quantized import model_weight_bytes
    if spec["dequantize"]:              # before: the experts dequantized at load (bf16 here)
        keep = moe_weights._gpt_oss_moe

        def dequantized(build, *args):
            build.keeps_mxfp4 = False
            return keep(build, *args)
        moe_weights._gpt_oss_moe = dequantized
    load_tokenizer(spec["model"])
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")                    # VmHWM reset to the current RSS
    before = _status("VmRSS:")
    start = time.perf_counter()
    llm = LLM(spec["model"], dtype="bfloat16", kv_cache_memory=64 * 1024**2, enable_prefix_caching=False)
    load_s = time.perf_counter() - start
    weights = model_weight_bytes(llm.engine.executor.worker.runner.model)
    return dict(load_s=load_s, peak_load_bytes=_status("VmHWM:") - before, resident_after_bytes=_status("VmRSS:") - before,
                weight_bytes=weights)


def _run_load(spec: dict) -> dict:
    res = subprocess.run([sys.executable, __file__, "--load-child", json.dumps(spec)], capture_output=True, text=True,
                         timeout=1800)
    if res.returncode:
        return {"error": res.stderr[-2000:]}
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    from pagedserve.kernels import quant
    from pagedserve.models.dummy import stand_in_tokenizer
    from pagedserve.models.loader import default_model_path
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2, help="layers of the shape (gpt-oss-20b: 24)")
    ap.add_argument("--vocab", type=int, default=GPT_OSS_20B["vocab_size"],
                    help="vocabulary (gpt-oss-20b's 201088: the default model's tokenizer padded with unused "
                         "tokens; the 2-layer runs before 2026-12-06 20:30 UTC: 49152, the default model's)")
    ap.add_argument("--no-native", action="store_true", help="skip pagedserve's GGUF run (llama-bench only)")
    ap.add_argument("--tiny", action="store_true", help="a narrow shape (checks the script)")
    ap.add_argument("--decode-len", type=int, default=32)
    ap.add_argument("--decode-rounds", type=int, default=3)
    ap.add_argument("--prefill-len", type=int, default=128)
    ap.add_argument("--llama-bench", default=None, help="llama.cpp's llama-bench, run on the same GGUF file")
    ap.add_argument("--llama-reps", type=int, default=None, help="llama-bench's -r (default: its own, 5)")
    ap.add_argument("--hf-modes", nargs="+", default=["mxfp4", "dequantized"], choices=["mxfp4", "dequantized"],
                    help="the HF loads measured (the whole shape's experts dequantized would need ~40 GB: mxfp4 only)")
    ap.add_argument("--gguf-only", action="store_true", help="skip the HF checkpoint's load measurements")
    ap.add_argument("--python-loop", action="store_true", help="the GGUF file through the Python layer loop too")
    ap.add_argument("--work-dir", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--load-child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.load_child:
        print(json.dumps(load_child(json.loads(args.load_child))))
        return
    threads = torch.get_num_threads()
    config = dict(GPT_OSS_20B, num_hidden_layers=args.layers, vocab_size=args.vocab)
    if args.tiny:
        config.update(hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                      num_local_experts=8, num_experts_per_tok=2)
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="pagedserve-gpt-oss-"))
    work.mkdir(parents=True, exist_ok=True)
    result = dict(threads=threads, shape=config, quant_kernels=quant.describe())
    try:
        name = _file_name(config)
        hf = work / f"hf{name}"
        if not args.gguf_only:
            if not (hf / "config.json").exists():
                print("  writing the HF checkpoint ...", flush=True)
                write_hf(config, hf)
            result["hf_bytes"] = sum(p.stat().st_size for p in hf.glob("*.safetensors"))
        for mode in () if args.gguf_only else args.hf_modes:
            print(f"  HF load, experts {mode} ...", flush=True)
            result[f"hf_load_{mode}"] = _run_load({"model": str(hf), "dequantize": mode == "dequantized"})
        path = work / f"gpt-oss-shape{name}.gguf"
        if not path.exists():
            print("  writing the GGUF file ...", flush=True)
            write_gguf(config, path, default_model_path())
        result["gguf_bytes"] = path.stat().st_size
        tokenizer = hf if (hf / "config.json").exists() else work / f"tokenizer{name}"
        if not (tokenizer / "tokenizer.json").exists():
            stand_in_tokenizer(config).save_pretrained(str(tokenizer))
        spec = dict(model=str(path), tokenizer=str(tokenizer), cache=str(work / "cache"), prefill_len=args.prefill_len,
                    decode_len=args.decode_len, repeats=1, batch=0, decode_rounds=args.decode_rounds,
                    kv_cache_memory=128 * 1024**2, sample_rss=True)
        if not args.no_native:
            print("  GGUF native ...", flush=True)
            result["gguf"] = child(spec, 1800)
        if args.python_loop:
            print("  GGUF native, the Python layer loop ...", flush=True)
            result["gguf_python_loop"] = child(dict(spec, python_loop=True), 1800)
        if args.llama_bench:
            print("  llama-bench ...", flush=True)
            result["llama_bench"] = llama_bench(args.llama_bench, str(path), threads, args.prefill_len, args.decode_len,
                                                max_rss=True, repetitions=args.llama_reps)
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    mib = 2**20
    if not args.gguf_only:
        print(f"\nHF checkpoint {result['hf_bytes'] / mib:.0f} MiB (experts MXFP4):")
    for mode in () if args.gguf_only else args.hf_modes:
        r = result[f"hf_load_{mode}"]
        print(f"  experts {mode:<12} " + (f"error: {r['error'].strip().splitlines()[-1]}" if "error" in r else
              f"peak load {r['peak_load_bytes'] / mib:>7.0f} MiB  resident after {r['resident_after_bytes'] / mib:>7.0f} MiB  "
              f"weights {r['weight_bytes'] / mib:>7.0f} MiB  load {r['load_s']:.1f} s"))
    g, lb, size = result.get("gguf") or {}, result.get("llama_bench") or {}, result["gguf_bytes"]
    print(f"GGUF {size / mib:.0f} MiB, {config['num_hidden_layers']} layers, vocabulary {config['vocab_size']}:")
    if "error" in g:
        print(f"  pagedserve: error: {g['error'].strip().splitlines()[-1]}")
    elif g:
        peak, after = g["peak_rss_load"] - g["rss_before_load"], g["rss_after"] - g["rss_before_load"]
        print(f"  pagedserve ({'compiled' if g.get('compiled_loop') else 'Python'} layer loop): load {g['load_s']:.1f} s, "
              f"peak RSS while loading {peak / mib:.0f} MiB ({peak / size:.2f}x the file), resident after "
              f"{after / mib:.0f} MiB ({after / size:.2f}x, KV cache {g['kv_cache_bytes'] / mib:.0f} MiB in it); "
              f"decode {g['decode_tok_s']:.2f} tok/s, prefill {g['prefill_tok_s'] or 0:.1f} tok/s")
    if "decode_tok_s" in lb:
        rss = f", peak RSS {lb['max_rss_bytes'] / mib:.0f} MiB ({lb['max_rss_bytes'] / size:.2f}x)" \
            if lb.get("max_rss_bytes") else ""
        print(f"  llama.cpp llama-bench: decode {lb['decode_tok_s']:.2f}, prefill {lb.get('prefill_tok_s') or 0:.1f} "
              f"tok/s{rss}")
    elif "error" in lb:
        print(f"  llama.cpp: {lb['error'][-300:]}")
    p = result.get("gguf_python_loop")
    if p and "error" not in p:
        print(f"  the Python layer loop: decode {p['decode_tok_s']:.2f} tok/s, prefill {p['prefill_tok_s'] or 0:.1f} tok/s")
    if args.tiny and not args.json:
        return
    out = Path(args.json) if args.json else RESULTS / "gpt_oss.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
