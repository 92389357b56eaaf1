"""Mixture-of-experts decode on the CPU: a random-weight OLMoE-1B-7B-shaped GGUF file, its experts
read only when routed to.

    .venv/bin/python benchmarks/moe.py                       # Q4_0, all 16 layers (~3.9 GB file)
    .venv/bin/python benchmarks/moe.py --mixes Q4_0 Q8_0 --layers 8
    .venv/bin/python benchmarks/moe.py --llama-bench /path/to/llama-bench
    .venv/bin/python benchmarks/moe.py --mixes Q4_K_M --llama-quantize /path/to/llama-quantize
    .venv/bin/python benchmarks/moe.py --tiny                # a 2-layer narrow shape: checks the script

The shape is OLMoE-1B-7B's (allenai/OLMoE-1B-7B-0924's config: hidden 2048, 16 layers, 16 heads of
128, 64 experts of FFN width 1024, 8 per token, q/k norms over all heads), with the default model's
49152-token vocabulary (its tokenizer goes into the file so llama.cpp loads it; OLMoE's is 50304):
6.9B weights in all, 1.3B read per token. The file is written by the gguf package as llama.cpp's
converter lays it out (experts stacked per projection: ffn_{gate,up,down}_exps; routers float32),
with random valid blocks (uniform nibbles / bytes, fp16 scales of a small spread: the routers then
spread tokens over the experts about evenly), in the mix's types (Q4_0: every matrix in Q4_0 but
the embedding and output in Q8_0; Q8_0: all in Q8_0; Q4_K_M: llama-quantize's mix of the Q8_0
file, requantized).

Each configuration runs in a child process (benchmarks/quantized.py's run_child): single-stream
decode tok/s (rounds of a 128-token prompt then decode steps: the median of the rounds' median
steps, and the best round), prefill tok/s (one 512-token prompt), batch tok/s (--batch requests
decoded together), resident memory against the file's size, and the weight bytes one decode token
reads (attention, the router, its k experts, the LM head: models/quantized.py
model_read_bytes_per_token) against the bound that reading them once per token at the measured
read bandwidth sets. With --llama-bench, llama.cpp's llama-bench on the same file and threads.
Results: a table, and benchmarks/results/moe.json. Measure only through /work/bin/timed (or on an
otherwise quiet machine).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
RESULTS = Path(__file__).resolve().parent / "results"

from benchmarks.quantized import DECODE_PROMPT_LEN, child, copy_tokenizer, llama_bench, llama_quantize  # noqa: E402
from tests.gguf_utils import finish, gguf_writer  # noqa: E402

# allenai/OLMoE-1B-7B-0924's config.json (the vocabulary: the default model's, see above)
OLMOE_1B_7B = dict(architectures=["OlmoeForCausalLM"], model_type="olmoe", hidden_size=2048, intermediate_size=1024,
                   num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16, num_experts=64,
                   num_experts_per_tok=8, norm_topk_prob=False, vocab_size=49152, max_position_embeddings=4096,
                   rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, clip_qkv=None,
                   bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16")
MIXES = {"Q4_0": {"*": "Q4_0", "token_embd": "Q8_0", "output": "Q8_0"}, "Q8_0": {"*": "Q8_0"},
         "Q4_K_M": None}        # llama-quantize's, from the Q8_0 file (--llama-quantize)
_SCALE = {"Q4_0": 0.004, "Q8_0": 0.0004}        # fp16 block scales: weights of std ~0.02


def _random_blocks(ggml: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random valid blocks of a matrix (or a stack of them) [..., rows, cols] in `ggml`."""
    import gguf
    qtype = gguf.GGMLQuantizationType[ggml]
    block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    *lead, cols = shape
    raw = rng.integers(0, 256, size=(*lead, cols // block, block_bytes), dtype=np.uint8)
    raw[..., :2] = np.full(raw.shape[:-1], _SCALE[ggml], np.float16)[..., None].view(np.uint8)
    return raw.reshape(*lead, cols // block * block_bytes)


def write_olmoe_gguf(config: dict, mix: dict, path: Path, tokenizer_from: str, seed: int = 0) -> None:
    """An `olmoe` GGUF file of `config`'s shape, tensor by tensor (a temporary file holds them as
    they are made: memory stays about one tensor)."""
    import gguf
    h, f, e = config["hidden_size"], config["intermediate_size"], config["num_experts"]
    q = config["num_attention_heads"] * (h // config["num_attention_heads"])
    kv = config["num_key_value_heads"] * (h // config["num_attention_heads"])
    w = gguf_writer(path, "olmoe", layers=config["num_hidden_layers"], context=config["max_position_embeddings"],
                    hidden=h, intermediate=f, heads=config["num_attention_heads"], kv_heads=config["num_key_value_heads"],
                    eps=config["rms_norm_eps"], vocab=config["vocab_size"], rope_theta=config["rope_theta"],
                    use_temp_file=True)
    w.add_expert_count(e)
    w.add_expert_used_count(config["num_experts_per_tok"])
    w.add_expert_feed_forward_length(f)
    copy_tokenizer(w, tokenizer_from)
    rng = np.random.default_rng(seed)

    def matrix(name: str, shape: tuple[int, ...], kind: str) -> None:
        ggml = mix.get(kind, mix["*"])
        w.add_tensor(name, _random_blocks(ggml, shape, rng), raw_dtype=gguf.GGMLQuantizationType[ggml])

    ones = lambda n: np.ones(n, dtype=np.float32)      # noqa: E731
    matrix("token_embd.weight", (config["vocab_size"], h), "token_embd")
    w.add_tensor("output_norm.weight", ones(h))
    matrix("output.weight", (config["vocab_size"], h), "output")
    for i in range(config["num_hidden_layers"]):
        p = f"blk.{i}."
        for kind, rows in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
            matrix(p + kind + ".weight", (rows, h), kind)
        matrix(p + "attn_output.weight", (h, q), "attn_output")
        for name, n in (("attn_norm", h), ("ffn_norm", h), ("attn_q_norm", q), ("attn_k_norm", kv)):
            w.add_tensor(p + name + ".weight", ones(n))
        w.add_tensor(p + "ffn_gate_inp.weight", rng.normal(0, 0.02, size=(e, h)).astype(np.float32))
        matrix(p + "ffn_gate_exps.weight", (e, f, h), "ffn_gate_exps")
        matrix(p + "ffn_up_exps.weight", (e, f, h), "ffn_up_exps")
        matrix(p + "ffn_down_exps.weight", (e, h, f), "ffn_down_exps")
    finish(w)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mixes", nargs="+", default=["Q4_0"], choices=list(MIXES))
    ap.add_argument("--layers", type=int, default=None, help="layers of the shape (default: OLMoE's 16)")
    ap.add_argument("--llama-bench", default=None, help="path of llama.cpp's llama-bench: run it on the same files")
    ap.add_argument("--llama-quantize", default=None, help="path of llama.cpp's llama-quantize: makes the Q4_K_M "
                                                          "mix from the Q8_0 file (requantized: random weights)")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer 256-wide shape: checks the script, measures nothing")
    ap.add_argument("--work-dir", default=None, help="where the GGUF files are written (default: a temporary dir)")
    ap.add_argument("--decode-rounds", type=int, default=3)
    ap.add_argument("--decode-len", type=int, default=32)
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=16, help="requests decoded at once for batch tok/s (0: skip)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from pagedserve.bench.throughput import read_bandwidth
    from pagedserve.kernels import cpu, quant
    from pagedserve.models.dummy import stand_in_tokenizer
    from pagedserve.models.loader import default_model_path
    threads = torch.get_num_threads()
    config = dict(OLMOE_1B_7B)
    if args.tiny:
        config.update(hidden_size=256, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=4, num_experts=8, num_experts_per_tok=2)
    if args.layers:
        config["num_hidden_layers"] = args.layers
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="pagedserve-moe-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"{threads} threads; measuring read bandwidth ...", flush=True)
    bandwidth = read_bandwidth(1 << 30)
    tokenizer_from = default_model_path()
    shape_dir = work / "olmoe-shape"
    shape_dir.mkdir(exist_ok=True)
    (shape_dir / "config.json").write_text(json.dumps(config))
    stand_in_tokenizer(config).save_pretrained(str(shape_dir))
    prefill_len = 64 if args.tiny else args.prefill_len
    base = dict(cache=str(work / "cache"), paired_probe=True, prefill_len=prefill_len, decode_len=args.decode_len, repeats=1,
                batch=args.batch, decode_rounds=args.decode_rounds, kv_cache_memory=256 * 1024**2)
    name = f"OLMoE-1B-7B shape ({config['num_hidden_layers']} layers)" if not args.tiny else "tiny MoE shape"
    runs = []
    try:
        for mix in args.mixes:
            path = work / f"olmoe-shape-{config['num_hidden_layers']}l-{mix}.gguf"
            if not path.exists() and MIXES[mix] is None:       # llama-quantize's mix, from the Q8_0 file
                if not args.llama_quantize:
                    ap.error(f"--mixes {mix} needs --llama-quantize")
                source = work / f"olmoe-shape-{config['num_hidden_layers']}l-Q8_0.gguf"
                if not source.exists():
                    print(f"  writing {source.name} ...", flush=True)
                    write_olmoe_gguf(config, MIXES["Q8_0"], source, tokenizer_from)
                print(f"  llama-quantize {mix} ...", flush=True)
                llama_quantize(args.llama_quantize, source, path, mix, threads, allow_requantize=True)
            elif not path.exists():
                print(f"  writing {path.name} ...", flush=True)
                write_olmoe_gguf(config, MIXES[mix], path, tokenizer_from)
            print(f"  {mix} native ...", flush=True)
            r = {"model": name, "config": f"{mix} native", "file_bytes": path.stat().st_size,
                 **child({**base, "model": str(path), "tokenizer": str(shape_dir)}, 1800)}
            if args.llama_bench:
                print("  llama-bench ...", flush=True)
                r["llama_bench"] = llama_bench(args.llama_bench, str(path), threads, prefill_len, args.decode_len)
            runs.append(r)
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\n{'model':<30} {'weights':<12} {'decode tok/s':>12} {'bound':>7} {'of bound':>8} {'paired':>6} {'prefill tok/s':>13} "
          f"{'batch tok/s':>11} {'file MiB':>9} {'resident MiB':>12} {'read/token MiB':>14} {'llama.cpp tg/pp':>16}")
    for r in runs:
        if "error" in r:
            print(f"{r['model']:<30} {r['config']:<12} error: {r['error'].strip().splitlines()[-1]}")
            continue
        r["bound_tok_s"] = bandwidth / r["bytes_per_token"]
        r["fraction_of_bound"] = r["decode_tok_s"] / r["bound_tok_s"]
        lb = r.get("llama_bench") or {}
        lbs = f"{lb.get('decode_tok_s', 0):.1f}/{lb.get('prefill_tok_s') or 0:.0f}" if "decode_tok_s" in lb else \
            "error (see JSON)" if "error" in lb else "-"
        print(f"{r['model']:<30} {r['config']:<12} {r['decode_tok_s']:>12.2f} {r['bound_tok_s']:>7.1f} "
              f"{r['fraction_of_bound']:>8.0%} {r.get('paired_fraction_of_bound') or 0:>6.0%} {r['prefill_tok_s'] or 0:>13.1f} {r.get('batch_tok_s') or 0:>11.1f} "
              f"{r['file_bytes'] / 2**20:>9.0f} {(r['rss_after'] - r['rss_before_load'] - r['kv_cache_bytes']) / 2**20:>12.0f} "
              f"{r['bytes_per_token'] / 2**20:>14.1f} {lbs:>16}")
    result = dict(threads=threads, read_bytes_s=bandwidth, shape=config, prefill_len=prefill_len,
                  decode_prompt_len=DECODE_PROMPT_LEN, decode_len=args.decode_len, decode_rounds=args.decode_rounds,
                  batch=args.batch, runs=runs, cpu_kernels=cpu.describe(), quant_kernels=quant.describe())
    if args.tiny and not args.json:
        return
    out = Path(args.json) if args.json else RESULTS / "moe.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
