"""Linear layers over GGUF block formats (kernels/quant.py) against the bf16 packed GEMM of
kernels/cpu.py, at a SmolLM2-1.7B-shaped layer (hidden 2048, MLP 8192: qkv 6144x2048, o
2048x2048, gate_up 16384x2048, down 2048x8192), over several layers' worth of distinct weights
so they stream from memory as in a real step.

    .venv/bin/python benchmarks/quant_kernels.py --quick     # ~1-2 min: 2 layers, T 1-128, the active variant
    .venv/bin/python benchmarks/quant_kernels.py --tiny      # seconds: shapes / 8 (checks the script runs)
    .venv/bin/python benchmarks/quant_kernels.py             # ~10 min: 4 layers, more T, every variant
    .venv/bin/python benchmarks/quant_kernels.py --decode [--quick] [--step-share Q4_0]
                      # decode (T=1) only, interleaved with a plain read of the same bytes; and the
                      # share of a real decode step outside the quantized linears (~2 min)
    .venv/bin/python benchmarks/quant_kernels.py --decode --quick --ab-source OTHER.cpp
                      # the same, interleaved with another build of quant_kernels.cpp (e.g. main's)
                      # (--ab-same-layout: both read this build's layouts, e.g. the r8 ones: one kernel's A/B;
                      # --ab-r8-fields 'q6_k=0:128:8,...': those types in the other's own r8 fields)

Per type and T: ms per pass over the layers, weight GB/s (bytes of the quantized weights read
per pass / time: the decode bound is the machine's read bandwidth, measured first) and GFLOP/s; the bf16 row is
the same shapes through cpu.linear over packed bf16 weights; rows with a `path` time the integer
path against the dequantized tiles at the same T (where SMALL_BATCH_ROWS and DECODE_BATCH_ROWS should
be). Prints a table and writes
benchmarks/results/quant_kernels.json with quant.describe() and cpu.describe().

--decode: per type, one pass at T=1 (--decode-tokens: decode batches of those sizes) over the layers' weights alternates with a plain read of the
same bytes (torch's threaded float sum over them) many times in one process, and the minimum of
each is kept (robust to other jobs on the machine): the kernel's GB/s against the read's; and the
same kernel over a weight kept in L2 ("in L2": its compute-bound rate, all threads). With
--step-share MIX (benchmarks/quantized.py's mixes: Q4_0, Q8_0, Q4_K_M), a SmolLM2-1.7B-shaped
GGUF of --layers layers (default 2) is written and served; its decode steps (engine.step, one
request) alternate with the same model's quantized linears alone at T=1 (every layer's and the
LM head), and the share of the step outside them (attention, norms, embedding, scheduling,
sampling, Python; the activations' quantization is inside) is printed, with the step's parts
(the compiled layer loop, the LM head, the rest), each the minimum over the steps. Writes
benchmarks/results/quant_kernels_decode.json.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.cpu_kernels import median_seconds  # noqa: E402
from pagedserve.kernels import cpu, quant  # noqa: E402

SHAPES = [(6144, 2048), (2048, 2048), (16384, 2048), (2048, 8192)]


def random_weight(qtype: str, rows: int, cols: int, rng: np.random.Generator) -> quant.QuantizedWeight:
    """Random quants with small fp16 scales in every scale field (values do not matter here)."""
    nb, bb = cols // quant.BLOCK[qtype], quant.BLOCK_BYTES[qtype]
    blocks = rng.integers(0, 256, size=(rows, nb, bb), dtype=np.uint8)
    scale = np.full((rows, nb, 1), 0.002, dtype=np.float16).view(np.uint8)
    for offset in {"q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,), "q4_1": (0, 2), "q5_1": (0, 2)}.get(qtype, (0,)):
        blocks[..., offset:offset + 2] = scale
    return quant.from_gguf_blocks(qtype, torch.from_numpy(blocks.reshape(rows, nb * bb)), (rows, cols))


def interleaved_min(fns, rounds: int) -> list[float]:
    """Seconds of each function: run in turn `rounds` times, the minimum of each."""
    best = [float("inf")] * len(fns)
    for fn in fns:
        fn()
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def other_build(source: str):
    """Another quant_kernels.cpp (e.g. main's: `git show main:pagedserve/kernels/quant_kernels.cpp`)
    built as the active variant, for an interleaved A/B of the decode kernels (--ab-source)."""
    lib = cpu.KernelLibrary(Path(source), quant.VARIANTS, "PAGEDSERVE_AB_UNUSED", quant._SIGNATURES,
                            "quant_kernel_variant", "A/B quant kernel", quant.logger, "%s unavailable: %s")
    built = lib.load_variant(quant.variant())
    if built is None:
        raise SystemExit(f"--ab-source {source}: variant {quant.variant()} did not build")
    return built


def parse_r8_fields(spec: str) -> dict[str, tuple[tuple[int, int, int], ...]]:
    """--ab-r8-fields: 'q6_k=0:128:8,128:64:8,192:16:2,208:2:2[;TYPE=...]' -> {file type: R8_FIELDS row}."""
    out = {}
    for part in filter(None, spec.split(";")):
        qtype, fields = part.split("=")
        out[qtype] = tuple(tuple(int(v) for v in f.split(":")) for f in fields.split(","))
    return out


def in_r8_fields(w: quant.QuantizedWeight, fields: dict) -> quant.QuantizedWeight:
    """w (an r8 layout) with its file type's R8_FIELDS row replaced by fields' (another build's r8
    layout, e.g. main's before a layout change): the same values, that build's bytes."""
    from pagedserve import quant_format
    file = quant_format.REPACKED.get(w.qtype)
    if w.qtype not in quant_format.R8 or file not in fields:
        return w
    plain, saved = quant.file_layout(w), quant_format.R8_FIELDS[file]
    quant_format.R8_FIELDS[file] = fields[file]
    quant_format._r8_places.cache_clear()
    try:
        nb = w.shape[1] // quant.BLOCK[w.qtype]
        return quant.QuantizedWeight(w.qtype, w.shape, quant_format.r8_order(w.qtype, plain.data, w.shape[0], nb, True))
    finally:
        quant_format.R8_FIELDS[file] = saved
        quant_format._r8_places.cache_clear()


def decode_kernels(types: list[str], layers: int, rounds: int, tokens: list[int], other=None,
                   same_layout: bool = False, other_fields: dict | None = None) -> list[dict]:
    """other: a second build (other_build) whose kernels run interleaved with these ("B/A");
    same_layout: it reads the layout this build's loader gives (else the file's); other_fields
    (parse_r8_fields): it reads this build's r8 layouts but those types' in its own fields."""
    rng = np.random.default_rng(0)
    results = []
    for qtype in types:
        # in the layout the loader gives them (quant.repack: q4_0 of whole 256-element units as q4_0x8)
        weights = [quant.repack(random_weight(qtype, n, k, rng)) for _ in range(layers) for n, k in SHAPES]
        nbytes = sum(w.nbytes for w in weights)
        # the same bytes as floats (a whole number of them per weight), summed: a plain read
        plain = [w.data.view(-1)[: w.data.numel() // 4 * 4].view(torch.float32) for w in weights]
        # The same kernel over a weight that stays in L2 (about 1 MiB a thread, called 20 times):
        # its compute-bound rate. Where it is well above `kernel`, the stream from memory bounds.
        # (rows a multiple of 8: else the r8 variants keep it in the file's layout and time another kernel)
        k0 = SHAPES[0][1]
        rows = (1 << 20) * torch.get_num_threads() // (k0 // quant.BLOCK[qtype] * quant.BLOCK_BYTES[qtype]) // 8 * 8
        cached = quant.repack(random_weight(qtype, max(8, rows), k0, rng))
        assert cached.qtype == weights[0].qtype, (cached.qtype, weights[0].qtype)
        for t in tokens:
            xs = {k: torch.randn(t, k).bfloat16() for _, k in SHAPES}
            fns = [lambda: [quant.linear(xs[w.shape[1]], w, decode=True) for w in weights],
                   lambda: [p.sum() for p in plain],
                   lambda: [quant.linear(xs[k0], cached, decode=True) for _ in range(20)]]
            if other is not None:     # both builds called alike (quant._linear_small), in turn; the other
                # (which may predate a repacked layout) on the file's, or with same_layout on this one's
                files, cached_file = (weights, cached) if same_layout else \
                    ([quant.file_layout(w) for w in weights], quant.file_layout(cached))
                if other_fields:
                    files, cached_file = [in_r8_fields(w, other_fields) for w in weights], in_r8_fields(cached, other_fields)
                for lib, ws, c in ((quant.load(), weights, cached), (other, files, cached_file)):
                    fns += [lambda lib=lib, ws=ws: [quant._linear_small(xs[w.shape[1]], [w], None, lib) for w in ws],
                            lambda lib=lib, c=c: [quant._linear_small(xs[k0], [c], None, lib) for _ in range(20)]]
            times = interleaved_min(fns, rounds)
            kernel, read, in_l2 = times[:3]
            row = dict(type=qtype, variant=quant.variant(), tokens=t, bytes=nbytes, kernel_gbs=nbytes / kernel / 1e9,
                       read_gbs=nbytes / read / 1e9, ratio=read / kernel, cached_gbs=20 * cached.nbytes / in_l2 / 1e9)
            if other is not None:
                row.update(ab_kernel_gbs=nbytes / times[5] / 1e9, ab_cached_gbs=20 * cached.nbytes / times[6] / 1e9,
                           ab_speedup=times[5] / times[3], ab_cached_speedup=times[6] / times[4])
            results.append(row)
            ab = "" if other is None else (f"  | --ab-source: kernel {row['ab_kernel_gbs']:6.1f} GB/s, in L2 "
                                           f"{row['ab_cached_gbs']:6.1f} GB/s (this build {row['ab_speedup']:.2f}x, "
                                           f"{row['ab_cached_speedup']:.2f}x)")
            print(f"{qtype:6} {row['variant']:11} T={t:<3} kernel {row['kernel_gbs']:6.1f} GB/s  plain read "
                  f"{row['read_gbs']:6.1f} GB/s  kernel/read {row['ratio']:.2f}  in L2 {row['cached_gbs']:6.1f} GB/s{ab}",
                  flush=True)
        del weights, plain
    return results


def step_share(mix: str, layers: int, rounds: int) -> dict:
    """A real decode step against its quantized linears alone (see the module's docstring)."""
    import tempfile

    from benchmarks.quantized import MIXES, SMOLLM2_1_7B, write_gguf
    from pagedserve import LLM, SamplingParams
    from pagedserve.models.dummy import stand_in_tokenizer
    from pagedserve.models.loader import default_model_path
    from pagedserve.models.quantized import weight_nbytes
    config = {**SMOLLM2_1_7B, "num_hidden_layers": layers}
    with tempfile.TemporaryDirectory(prefix="pagedserve-step-share-") as work:
        shape_dir = Path(work) / "shape"
        shape_dir.mkdir()
        (shape_dir / "config.json").write_text(json.dumps(config))
        stand_in_tokenizer(config).save_pretrained(str(shape_dir))
        path = Path(work) / f"{mix}.gguf"
        print(f"writing a {layers}-layer {mix} file ...", flush=True)
        write_gguf(config, MIXES[mix], path, tokenizer_from=default_model_path())
        llm = LLM(str(path), tokenizer=str(shape_dir), kv_cache_memory=128 * 1024**2, enable_prefix_caching=False)
        model = llm.engine.executor.worker.runner.model
        linears = [getattr(w, n) for w in model.layers for n in ("qkv", "o", "gate_up", "down")] + [model.lm_head]
        nbytes = sum(weight_nbytes(w) for w in linears)
        hidden = config["hidden_size"]
        xs = {k: torch.randn(1, k).bfloat16() for k in (hidden, config["intermediate_size"])}
        in_features = lambda w: (w[0] if isinstance(w, (tuple, list)) else w).shape[1]   # noqa: E731
        engine = llm.engine
        steps = 8 + 4 * rounds
        engine.add_request("d", {"prompt_token_ids": list(range(3, 131))},
                           SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True))
        engine.step()                                   # prefill
        for _ in range(4):
            engine.step()
        # The step's parts, each the minimum over the steps: the compiled layer loop (its linears,
        # attention, norms), the LM head (compute_logits) and the rest (embedding, engine, sampling).
        parts = {"layers": float("inf"), "lm_head": float("inf")}
        spent: dict[str, float] = {}

        def timed(obj, name: str, label: str) -> None:
            fn = getattr(obj, name)

            def wrapper(*args, **kwargs):
                start = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    spent[label] = spent.get(label, 0.0) + time.perf_counter() - start
            setattr(obj, name, wrapper)
        if model.compiled_layers is not None:
            timed(model.compiled_layers, "forward", "layers")
        timed(model, "compute_logits", "lm_head")

        def step() -> None:
            spent.clear()
            engine.step()
            for k, v in spent.items():
                parts[k] = min(parts[k], v)
        step_s, lin = interleaved_min([step, lambda: [quant.linear(xs[in_features(w)], w) for w in linears]],
                                      rounds)
        while engine.has_unfinished_requests():
            engine.step()
    out = dict(mix=mix, layers=layers, linear_bytes=nbytes, step_ms=step_s * 1e3, linears_ms=lin * 1e3,
               layer_loop_ms=parts["layers"] * 1e3, lm_head_ms=parts["lm_head"] * 1e3,
               outside_share=1 - lin / step_s, linears_gbs=nbytes / lin / 1e9)
    print(f"{mix} {layers} layers: decode step {out['step_ms']:.2f} ms (layer loop {out['layer_loop_ms']:.2f}, "
          f"LM head {out['lm_head_ms']:.2f}, the rest {out['step_ms'] - out['layer_loop_ms'] - out['lm_head_ms']:.2f}); "
          f"its quantized linears alone {out['linears_ms']:.2f} ms ({out['linears_gbs']:.1f} GB/s): "
          f"{out['outside_share']:.0%} of the step outside them", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--tiny", action="store_true", help="shapes / 8, one layer: checks the script runs")
    parser.add_argument("--types", default=",".join(quant.QTYPES))
    parser.add_argument("--out", default=None, help="default: results/quant_kernels.json (_decode.json with --decode)")
    parser.add_argument("--decode", action="store_true", help="T=1 only, against a plain read (interleaved)")
    parser.add_argument("--step-share", default=None, help="with --decode: a mix of benchmarks/quantized.py")
    parser.add_argument("--decode-tokens", default="1", help="with --decode: activation rows (decode batch sizes)")
    parser.add_argument("--ab-source", default=None, help="with --decode: another quant_kernels.cpp, built and "
                        "interleaved with this one (an A/B of the decode kernels in one process)")
    parser.add_argument("--ab-same-layout", action="store_true", help="with --ab-source: the other build reads "
                        "this one's layout (e.g. both the r8 layouts: an A/B of one kernel), not the file's")
    parser.add_argument("--ab-r8-fields", default=None, help="with --ab-source: the other build reads this one's r8 "
                        "layouts, but these file types' in its own R8_FIELDS rows (its layout before a change), e.g. "
                        "'q6_k=0:128:8,128:64:8,192:16:2,208:2:2'")
    args = parser.parse_args()
    results_dir = Path(__file__).parent / "results"
    if args.decode:
        layers = args.layers or (1 if args.tiny else 2)
        rounds = 3 if args.tiny else 10 if args.quick else 30
        if args.tiny:
            SHAPES[:] = [(n // 8, k // 8) for n, k in SHAPES]   # (decode_kernels reads the module's list)
        out = dict(quant=quant.describe(), threads=torch.get_num_threads(), layers=layers, rounds=rounds,
                   kernels=decode_kernels(args.types.split(","), layers, rounds,
                                          [int(t) for t in args.decode_tokens.split(",")],
                                          other_build(args.ab_source) if args.ab_source else None,
                                          args.ab_same_layout,
                                          parse_r8_fields(args.ab_r8_fields) if args.ab_r8_fields else None))
        if args.step_share:
            out["step_share"] = step_share(args.step_share, layers, rounds)
        path = Path(args.out or results_dir / "quant_kernels_decode.json")
        path.write_text(json.dumps(out, indent=1))
        print(f"wrote {path}")
        return
    if args.tiny:
        SHAPES[:] = [(n // 8, k // 8) for n, k in SHAPES]
    layers = args.layers or (1 if args.tiny else 2 if args.quick else 4)
    tokens = [1, 20] if args.tiny else [1, 4, 16, 128] if args.quick else [1, 2, 4, 8, 16, 32, 128, 512]
    crossover = [12, 20] if args.tiny else [8, 16, 32] if args.quick else [8, 16, 24, 32, 48, 64]
    variants = [quant.variant()] if args.quick or args.tiny else quant.supported_variants()
    repeats = 3 if args.quick else 5
    rng = np.random.default_rng(0)
    params = layers * sum(n * k for n, k in SHAPES)
    results = []

    # The machine's read bandwidth (torch's threaded sum over 256 MiB): the bound decode should reach.
    probe = torch.ones((16 if args.tiny else 256) << 18, dtype=torch.float32)
    sec = median_seconds(lambda: probe.sum(), repeats)
    read_gbs = probe.numel() * 4 / sec / 1e9
    print(f"read bandwidth (torch sum): {read_gbs:.1f} GB/s")
    del probe

    bf16 = [cpu.pack_weight(torch.randn(n, k).bfloat16()) for _ in range(layers) for n, k in SHAPES]
    for t in tokens:
        xs = {k: torch.randn(t, k).bfloat16() for _, k in SHAPES}
        sec = median_seconds(lambda: [cpu.linear(xs[w.in_features], w) for w in bf16], repeats)
        results.append(dict(type="bf16 packed", variant=cpu.variant(), tokens=t, ms=1e3 * sec,
                            weight_gbs=2 * params / sec / 1e9, gflops=2 * t * params / sec / 1e9))
        print(f"{'bf16 packed':12} {cpu.variant():11} T={t:4} {1e3 * sec:9.2f} ms {2 * params / sec / 1e9:7.1f} GB/s")
    del bf16

    for qtype in args.types.split(","):
        weights = [random_weight(qtype, n, k, rng) for _ in range(layers) for n, k in SHAPES]
        nbytes = sum(w.nbytes for w in weights)
        for name in variants:
            with quant.using_variant(name):
                for t in tokens:
                    xs = {k: torch.randn(t, k).bfloat16() for _, k in SHAPES}
                    sec = median_seconds(lambda: [quant.linear(xs[w.shape[1]], w) for w in weights], repeats)
                    results.append(dict(type=qtype, variant=name, tokens=t, ms=1e3 * sec,
                                        weight_gbs=nbytes / sec / 1e9, gflops=2 * t * params / sec / 1e9))
                    print(f"{qtype:12} {name:11} T={t:4} {1e3 * sec:9.2f} ms {nbytes / sec / 1e9:7.1f} GB/s "
                          f"{2 * t * params / sec / 1e9:7.1f} GFLOP/s")
                # Where the integer path should hand over to the tiles (quant.SMALL_BATCH_ROWS).
                for t in crossover:
                    xs = {k: torch.randn(t, k).bfloat16() for _, k in SHAPES}
                    lib = quant.load()
                    for path, fn in (("integer", quant._linear_small), ("tiles", quant._linear_tiles)):
                        sec = median_seconds(lambda: [fn(xs[w.shape[1]], [w], None, lib) for w in weights], repeats)
                        results.append(dict(type=qtype, variant=name, tokens=t, path=path, ms=1e3 * sec,
                                            weight_gbs=nbytes / sec / 1e9, gflops=2 * t * params / sec / 1e9))
                        print(f"{qtype:12} {name:11} T={t:4} {path:8} {1e3 * sec:9.2f} ms")
        del weights

    out = Path(args.out or results_dir / "quant_kernels.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(quant=quant.describe(), cpu=cpu.describe(), layers=layers, read_gbs=read_gbs,
                                   threads=torch.get_num_threads(), results=results), indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
