"""The Triton kernels against the torch reference, run under Triton's interpreter on CPU
(conftest sets TRITON_INTERPRET=1 when there is no GPU; with one, they run compiled).

The interpreter costs about a millisecond per tile operation, so each case is sized to
cover its dimensions without a full cross product: block sizes 16/32, head dims 64/128,
GQA ratios 1/3/8, context lengths 1..3000, batches of 1..33, float32 and bfloat16.
"""

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.attention.torch_backend import TorchAttention, write_kv as torch_write_kv
from pagedserve.attention.triton_backend import TritonAttention
from pagedserve.attention.triton_cache_ops import copy_blocks, write_kv
from pagedserve.attention.triton_decode import (MAX_PARTITIONS, MIN_PARTITION, choose_splits, decode_grid,
                                               paged_decode_attention, partition_tokens)
from pagedserve.attention.triton_utils import check_device, is_interpreted
from pagedserve.attention.triton_prefill import paged_prefill_attention
from tests.conftest import PROMPTS
from tests.test_attention import dense_reference, make_batch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def test_kernels_run_where_expected():
    """On a CPU-only machine the kernels must be the interpreted ones (conftest's doing)."""
    if DEVICE.type == "cpu":
        assert is_interpreted(paged_decode_attention.__globals__["_decode_kernel"]), \
            "TRITON_INTERPRET=1 was not set before triton was first imported"


def to_device(cache, q, k, v, meta, dtype=torch.float32):
    d = DEVICE
    meta = AttentionMetadata(meta.slot_mapping.to(d), meta.query_start_loc.to(d), meta.seq_lens.to(d),
                             meta.block_tables.to(d), meta.num_decodes, meta.query_start_loc_cpu,
                             meta.seq_lens_cpu, meta.max_seq_len)
    return cache.to(d, dtype), q.to(d, dtype), k.to(d, dtype), v.to(d, dtype), meta


def reference(cache, q, k, v, meta, scale):
    """The torch backend on a copy of the cache, in float32 on the CPU."""
    cache = cache.float().cpu().clone()
    meta = AttentionMetadata(meta.slot_mapping.cpu(), meta.query_start_loc.cpu(), meta.seq_lens.cpu(),
                             meta.block_tables.cpu(), meta.num_decodes, meta.query_start_loc_cpu,
                             meta.seq_lens_cpu, meta.max_seq_len)
    out = TorchAttention().forward(q.float().cpu(), k.float().cpu(), v.float().cpu(), cache, meta, scale)
    return out, cache


# ---- KV write and block copy ------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_lands_in_slots_and_skips_negative_slots(dtype):
    g = torch.Generator().manual_seed(0)
    num_blocks, block_size, hkv, d = 40, 16, 3, 64
    cache = torch.randn(2, num_blocks, block_size, hkv, d, generator=g).to(DEVICE, dtype)
    n = 70
    slots = torch.randperm(num_blocks * block_size, generator=g)[:n]
    slots[[5, 33]] = -1                          # padding tokens: written nowhere
    # A strided view for v, as the model passes it (a slice of the fused qkv output).
    qkv = torch.randn(n, 3 * hkv, d, generator=g).to(DEVICE, dtype)
    k, v = qkv[:, hkv:2 * hkv], qkv[:, 2 * hkv:]
    expected = cache.clone()
    keep = slots >= 0
    torch_write_kv(expected, k[keep.to(DEVICE)], v[keep.to(DEVICE)], slots[keep].to(DEVICE))
    write_kv(cache, k, v, slots.to(DEVICE))
    assert torch.equal(cache, expected)


def test_copy_blocks_in_place_and_between_caches():
    g = torch.Generator().manual_seed(1)
    layers, num_blocks, block_size, hkv, d = 3, 24, 32, 2, 128
    cache = torch.randn(layers, 2, num_blocks, block_size, hkv, d, generator=g).to(DEVICE)
    pairs = [(3, 17), (0, 5), (22, 1), (3, 9)]   # one source copied twice
    expected = cache.clone()
    for s, t in pairs:
        expected[:, :, t] = expected[:, :, s]
    copy_blocks(cache, cache, pairs)
    assert torch.equal(cache, expected)
    # To another tensor of a different number of blocks (a swap staging buffer), and back.
    staging = torch.zeros(layers, 2, 4, block_size, hkv, d, device=DEVICE)
    copy_blocks(cache, staging, [(7, 0), (12, 3)])
    assert torch.equal(staging[:, :, 0], cache[:, :, 7]) and torch.equal(staging[:, :, 3], cache[:, :, 12])
    assert not staging[:, :, 1:3].any()
    copy_blocks(staging, cache, [(3, 2)])
    assert torch.equal(cache[:, :, 2], cache[:, :, 12])
    with pytest.raises(ValueError, match="one layout"):
        copy_blocks(cache, staging.to(torch.bfloat16), [(0, 0)])


# ---- decode ------------------------------------------------------------------------------

def rounded(dtype, *tensors):
    """For bfloat16 cases: the inputs rounded to bfloat16, so the float32 reference sees
    exactly the values the kernel sees and only the kernel's own rounding differs."""
    return [t.to(dtype).float() for t in tensors]


def decode_case(ctx_lens, block_size, num_heads, num_kv_heads, head_dim, dtype, num_splits, seed, max_seq_len=None):
    specs = [(c - 1, 1) for c in ctx_lens]      # context after the step = c
    num_blocks = sum(-(-c // block_size) for c in ctx_lens) + 8
    cache, q, k, v, meta, _ = make_batch(specs, block_size, num_kv_heads, head_dim, num_heads, num_blocks, seed=seed)
    cache, q, k, v = rounded(dtype, cache, q, k, v)
    scale = head_dim ** -0.5
    ref, ref_cache = reference(cache, q, k, v, meta, scale)
    cache, q, k, v, meta = to_device(cache, q, k, v, meta, dtype)
    write_kv(cache, k, v, meta.slot_mapping)
    out = paged_decode_attention(q, cache, meta.block_tables, meta.seq_lens, scale, max_seq_len or meta.max_seq_len,
                                 num_splits=num_splits)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float().cpu(), ref, atol=tol, rtol=tol)
    assert torch.equal(cache.float().cpu(), ref_cache)


@pytest.mark.parametrize(
    "ctx_lens,block_size,num_heads,num_kv_heads,head_dim,dtype,num_splits", [
        # 33 sequences of 1..200 tokens, GQA 3, one partition each.
        ([1, 2, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 127, 128, 129, 200] + list(range(3, 200, 12))[:17],
         16, 3, 1, 64, torch.float32, None),
        # One 3000-token context split 6 ways (partitions of 512) beside a 1-token one; GQA 8.
        ([3000, 1], 32, 8, 1, 128, torch.float32, 6),
        # bfloat16, GQA 1, split 3 ways (partitions of 256; the shorter sequences use fewer).
        ([700, 300, 5, 257, 64], 16, 2, 2, 128, torch.bfloat16, 3),
        # A single sequence (batch of 1), block size 32, GQA 8 with two KV heads.
        ([450], 32, 16, 2, 64, torch.float32, None),
    ])
def test_decode_equals_torch_reference(ctx_lens, block_size, num_heads, num_kv_heads, head_dim, dtype,
                                       num_splits):
    decode_case(ctx_lens, block_size, num_heads, num_kv_heads, head_dim, dtype, num_splits, seed=len(ctx_lens))


def test_split_choice():
    # Enough (sequence, head) programs: no split; otherwise split long contexts only.
    assert choose_splits(3000, 64, 8, 132) == 1
    assert choose_splits(200, 1, 1, 132) == 1
    assert 1 < choose_splits(32000, 1, 8, 132) <= MAX_PARTITIONS
    with pytest.raises(ValueError, match="num_splits"):
        q = torch.zeros(1, 2, 64, device=DEVICE)
        paged_decode_attention(q, torch.zeros(2, 4, 16, 2, 64, device=DEVICE), torch.zeros(1, 4, dtype=torch.long),
                               torch.ones(1, dtype=torch.long), 1.0, 1, num_splits=0)


def test_graph_decode_grid_does_not_grow_with_max_model_len():
    """A CUDA graph launches decode for max_model_len (a bound on every context). The grid
    is (sequence, KV head, split) with the splits set by the batch and the GPU, not by
    max_model_len, and each sequence divides its own context between the splits: a short
    context in a graph sized for 128k tokens keeps the GPU as busy as a long one (before,
    one partition of max_model_len / splits tokens held the whole short context)."""
    sms = 132
    for b, hkv in [(1, 8), (4, 8), (8, 3), (64, 8)]:
        grids = {decode_grid(b, hkv, choose_splits(m, b, hkv, sms)) for m in (16384, 32768, 131072)}
        assert len(grids) == 1, grids
        (grid,) = grids
        assert grid[2] * b * hkv <= max(2 * sms + b * hkv, b * hkv)    # about twice the SMs, never more
    splits = choose_splits(131072, 1, 8, sms)
    assert splits == 33
    live = lambda n: -(-n // partition_tokens(n, splits))    # partitions that hold tokens
    assert live(2000) >= 7 and partition_tokens(2000, splits) == MIN_PARTITION
    assert live(100) == 1 and live(131072) == splits
    assert partition_tokens(131072, splits) * splits >= 131072
    # Eagerly, a short context gets one split: a grid of (sequences, KV heads, 1).
    assert decode_grid(1, 8, choose_splits(200, 1, 8, sms)) == (1, 8, 1)


def test_decode_split_for_a_bound_far_past_the_contexts():
    """The graph's launch: max_seq_len far above every context, many splits (each sequence
    splits its own context), the same output as the reference."""
    decode_case([700, 300, 5, 257, 64, 1], 16, 4, 2, 64, torch.float32, num_splits=5, seed=3, max_seq_len=1 << 17)


# ---- prefill -----------------------------------------------------------------------------

@pytest.mark.parametrize("specs,block_size,num_heads,num_kv_heads,head_dim,dtype", [
    # (cached context, new tokens): fresh prompts across two query tiles, a prefix ending
    # inside a block, a chunk of one block; GQA 8, block 16, head dim 64.
    ([(0, 100), (37, 50), (64, 16)], 16, 8, 1, 64, torch.float32),
    # A long cached prefix (1500 tokens) and a short chunk; GQA 3, block 32, head dim 128.
    ([(1500, 30), (0, 7)], 32, 3, 1, 128, torch.float32),
    # bfloat16, GQA 1.
    ([(90, 40), (0, 70)], 16, 2, 2, 128, torch.bfloat16),
])
def test_prefill_equals_torch_reference(specs, block_size, num_heads, num_kv_heads, head_dim, dtype):
    num_blocks = sum(-(-(c + n) // block_size) for c, n in specs) + 8
    cache, q, k, v, meta, history = make_batch(specs, block_size, num_kv_heads, head_dim, num_heads, num_blocks,
                                               seed=7)
    cache, q, k, v = rounded(dtype, cache, q, k, v)
    history = [rounded(dtype, *h) for h in history]
    scale = head_dim ** -0.5
    ref, _ = reference(cache, q, k, v, meta, scale)
    cache, q, k, v, meta = to_device(cache, q, k, v, meta, dtype)
    write_kv(cache, k, v, meta.slot_mapping)
    out = torch.full_like(q, float("nan"))
    qsl = meta.query_start_loc_cpu
    paged_prefill_attention(q, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale,
                            first_seq=0, num_seqs=len(specs), max_query_len=max(n for _, n in specs), out=out)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float().cpu(), ref, atol=tol, rtol=tol)
    # The float64 dense reference agrees too (the torch backend is itself checked against it).
    for i in range(len(specs)):
        dense = dense_reference(q[qsl[i]:qsl[i + 1]].float().cpu(), *history[i], scale)
        torch.testing.assert_close(out[qsl[i]:qsl[i + 1]].float().cpu(), dense, atol=3 * tol, rtol=3 * tol)


# ---- sliding window, soft-capping, sinks ------------------------------------------------

def window_batch(window, block_size, num_heads, num_kv_heads, head_dim, seed):
    """A mixed batch of one KV group with a sliding window, as the worker builds it: each
    table's blocks wholly before its first query's window are holes (-1), and their cache
    blocks hold NaN (a kernel that reads one fails). Returns the poisoned cache, the clean one
    (for the reference), q, metadata."""
    from pagedserve.batch import ScheduledTokens
    from pagedserve.worker.model_runner import prepare_batch
    g = torch.Generator().manual_seed(seed)
    # (context after the step, new tokens): decodes first (one past the split's MIN_PARTITION),
    # then a fresh prompt over two query tiles, a chunk after a cached prefix, a short chunk.
    specs = [(300, 1), (37, 1), (5, 1), (70, 70), (230, 80), (52, 7)]
    cache = torch.randn(2, 64, block_size, num_kv_heads, head_dim, generator=g)
    seqs, poison, free = [], [], list(torch.randperm(64, generator=g).tolist())
    for i, (length, new) in enumerate(specs):
        table = [free.pop() for _ in range(-(-length // block_size))]
        first = 0 if window is None else max(0, length - new - window + 1) // block_size
        poison += table[:first]
        seqs.append(ScheduledTokens(i, [0] * new, length - new, [-1] * first + table[first:]))
    _, _, meta = prepare_batch(seqs, block_size, "cpu", windows=(window,))
    meta.groups = []                       # one group: the metadata the layer is given
    q = torch.randn(meta.query_start_loc_cpu[-1], num_heads, head_dim, generator=g)
    poisoned = cache.clone()
    poisoned[:, poison] = float("nan")
    return poisoned, cache, q, meta


@pytest.mark.parametrize("window,softcap,with_sinks,dtype,num_splits", [
    (10, 0.0, False, torch.float32, 3),      # a window shorter than a key tile (and than a block pair)
    (100, 2.0, True, torch.float32, 2),      # a window over several key tiles, with all three
    (None, 1.5, True, torch.bfloat16, 2),    # soft-capping and sinks over full attention
    (40, 0.0, True, torch.bfloat16, None),
])
def test_window_softcap_and_sinks_equal_torch_reference(window, softcap, with_sinks, dtype, num_splits):
    """The kernels with a sliding window (no block before it is read: those hold NaN and
    their table entries are -1), soft-capping and per-head sinks equal the torch reference,
    decodes split and not, prefill chunks across query tiles."""
    block_size, hq, hkv, d = 16, 4, 2, 32
    poisoned, clean, q, meta = window_batch(window, block_size, hq, hkv, d, seed=window or 1)
    sinks = torch.randn(hq) * 2 if with_sinks else None
    clean, q = rounded(dtype, clean, q)
    scale = d ** -0.5
    ref = TorchAttention()._reference(q, None, None, clean, meta, scale, softcap, sinks)
    cache = poisoned.to(DEVICE, dtype)
    qd = q.to(DEVICE, dtype)
    dmeta = to_device(cache, qd, qd, qd, meta)[-1]
    dmeta.window = meta.window
    sinks_d = sinks.to(DEVICE) if sinks is not None else None
    out = TritonAttention(DEVICE)._attend(qd, cache, dmeta, scale, softcap, sinks_d)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert not out.isnan().any()
    torch.testing.assert_close(out.float().cpu(), ref, atol=tol, rtol=tol)
    nd = meta.num_decodes
    split = paged_decode_attention(qd[:nd], cache, dmeta.block_tables[:nd], dmeta.seq_lens[:nd], scale,
                                   meta.max_seq_len, num_splits=num_splits or 1, window=window, softcap=softcap,
                                   sinks=sinks_d)
    torch.testing.assert_close(split.float().cpu(), ref[:nd], atol=tol, rtol=tol)


def test_bad_window_and_sinks_are_refused():
    q = torch.zeros(1, 2, 16, device=DEVICE)
    cache = torch.zeros(2, 4, 16, 2, 16, device=DEVICE)
    args = (q, cache, torch.zeros(1, 4, dtype=torch.long, device=DEVICE), torch.ones(1, dtype=torch.long,
                                                                                       device=DEVICE), 1.0, 1)
    with pytest.raises(ValueError, match="window"):
        paged_decode_attention(*args, window=0)
    with pytest.raises(ValueError, match="sinks"):
        paged_decode_attention(*args, sinks=torch.zeros(3, device=DEVICE))


# ---- the backend on a mixed batch, and in the engine --------------------------------------

def test_backend_forward_on_a_mixed_batch():
    """Decodes then prefills in one flat batch, exactly as the model runner builds it."""
    specs = [(0, 1), (40, 1), (310, 1), (0, 23), (77, 9), (16, 1 + 47)]
    cache, q, k, v, meta, _ = make_batch(specs, 32, 2, 128, 6, num_blocks=40, seed=3)
    ref, ref_cache = reference(cache, q, k, v, meta, 0.1)
    cache, q, k, v, meta = to_device(cache, q, k, v, meta)
    out = TritonAttention(DEVICE).forward(q, k, v, cache, meta, 0.1)
    torch.testing.assert_close(out.cpu(), ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(cache.cpu(), ref_cache)


def test_engine_greedy_tokens_equal_torch_backend(tiny_llama):
    """The whole engine with the triton backend: same greedy tokens as the torch backend,
    including copy-on-write of a shared partial block (n=2 forks the prompt's blocks)."""
    prompts = [tiny_llama.tokenizer.encode(p) for p in PROMPTS[:3]]
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)] * 2 + \
        [SamplingParams(n=2, temperature=0, max_tokens=6, ignore_eos=True)]

    def run(backend):
        llm = LLM(tiny_llama.path, dtype="float32", num_gpu_blocks_override=64, block_size=16,
                  device=DEVICE.type, attention_backend=backend)
        copies = []
        runner_copy = llm.engine.runner.copy_blocks
        llm.engine.runner.copy_blocks = lambda pairs: (copies.extend(pairs), runner_copy(pairs))
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        stats = llm.kv_cache_stats()
        assert stats["num_used_blocks"] == 0
        return [[c.token_ids for c in o.outputs] for o in outs], copies, llm.engine.runner.model.attention.name

    torch_tokens, torch_copies, name = run("torch")
    assert name == "torch"
    triton_tokens, triton_copies, name = run("triton")
    assert name == "triton"
    assert triton_tokens == torch_tokens
    assert triton_copies and triton_copies == torch_copies   # copy-on-write went through the kernel


def test_bad_device_and_backend_choices_are_refused(tiny_llama):
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU"):
            LLM(tiny_llama.path, device="cuda")
    with pytest.raises(ValueError, match="attention_backend"):
        LLM(tiny_llama.path, attention_backend="flash")
    with pytest.raises(ValueError, match="device"):
        LLM(tiny_llama.path, device="tpu")
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        LLM(tiny_llama.path, gpu_memory_utilization=1.5)
    # A compiled (not interpreted) kernel on CPU tensors is refused with a hint.
    from triton.runtime.jit import JITFunction
    compiled = JITFunction(paged_decode_attention.__globals__["_decode_kernel"].fn)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        check_device(compiled, torch.device("cpu"))


# ---- the kernels compile for a GPU ------------------------------------------------------

_COMPILE = """
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
for name, module, sig, consts, attrs, opts in json.loads(sys.stdin.read()):
    kernel = getattr(importlib.import_module(module), name)
    attrs = {tuple(k): [["tt.divisibility", 16]] for k in attrs}
    compiled = triton.compile(ASTSource(kernel, sig, constexprs=consts, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options=opts)
    print(name, len(compiled.asm["cubin"]), "bytes of sm_90 code,", compiled.metadata.shared, "of shared memory")
"""

_TYPES = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.int64: "*i64",
          torch.int32: "*i32"}


def _signature(fn, args, kwargs):
    """What Triton's JIT would specialise a launch on: argument types, constexprs (and
    integers equal to 1), and 16-divisibility of pointers and integers."""
    import inspect
    params = list(inspect.signature(fn).parameters.values())
    values = dict(zip([p.name for p in params], args)) | {k: v for k, v in kwargs.items()
                                                           if k in {p.name for p in params}}
    sig, consts, attrs = {}, {}, []
    for i, p in enumerate(params):
        v = values[p.name]
        if "constexpr" in str(p.annotation) or (isinstance(v, int) and not isinstance(v, bool) and v == 1):
            sig[p.name], consts[p.name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            sig[p.name] = _TYPES[v.dtype]
            if v.data_ptr() % 16 == 0:
                attrs.append([i])
        elif isinstance(v, float):
            sig[p.name] = "fp32"
        else:
            sig[p.name] = "i32" if -2**31 <= v < 2**31 else "i64"
            if v % 16 == 0:
                attrs.append([i])
    return sig, consts, attrs


@pytest.mark.skipif(DEVICE.type == "cuda", reason="on a GPU every launch compiles anyway")
def test_kernels_compile_for_sm90(monkeypatch):
    """The interpreter never compiles, so a kernel that Triton's compiler would reject could
    pass every test above. Record real bfloat16 launches (decode with and without a split,
    prefill, KV write, block copy; decode and prefill with a window, soft-capping and sinks; head
    dim 256), then compile each, specialised as the JIT would, to sm_90 (H100/H200) machine code
    with Triton's bundled ptxas, in a process without the interpreter, each within a block's
    shared memory. No GPU is needed."""
    import json
    import subprocess
    import sys
    from triton.runtime.interpreter import InterpretedFunction
    launches = {}
    run = InterpretedFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        key = (self.fn.__name__, kwargs.get("SPLIT"), kwargs.get("SOFTCAP"), kwargs.get("HAS_SINKS"),
               kwargs.get("HEAD_DIM"))
        launches.setdefault(key, (self.fn, args, kwargs))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", record)
    specs = [(300, 1), (20, 1), (0, 70), (33, 20)]
    cache, q, k, v, meta, _ = make_batch(specs, 16, 2, 128, 16, num_blocks=40, seed=5)
    cache, q, k, v, meta = to_device(cache, q, k, v, meta, torch.bfloat16)
    TritonAttention(DEVICE).forward(q, k, v, cache, meta, 0.1)
    paged_decode_attention(q[:2], cache, meta.block_tables, meta.seq_lens, 0.1, 301, num_splits=2)
    copy_blocks(cache, cache, [(1, 2)])
    # A sliding window with soft-capping and sinks (Gemma 2 / gpt-oss layers): decode, split decode, prefill.
    meta.window = 40
    sinks = torch.randn(16, device=DEVICE, dtype=torch.bfloat16)
    TritonAttention(DEVICE).forward(q, k, v, cache, meta, 0.1, softcap=30.0, sinks=sinks)
    paged_decode_attention(q[:2], cache, meta.block_tables, meta.seq_lens, 0.1, 301, num_splits=2, window=40,
                           softcap=30.0, sinks=sinks)
    # Gemma 2 / 3's head dim 256 (its prefill tiles must fit a block's shared memory).
    cache, q, k, v, meta, _ = make_batch([(30, 1), (0, 40)], 16, 2, 256, 4, num_blocks=8, seed=6)
    cache, q, k, v, meta = to_device(cache, q, k, v, meta, torch.bfloat16)
    TritonAttention(DEVICE).forward(q, k, v, cache, meta, 0.1)
    jobs = []
    for fn, args, kwargs in launches.values():
        sig, consts, attrs = _signature(fn, args, kwargs)
        opts = {k: kwargs[k] for k in ("num_warps",) if k in kwargs}
        jobs.append([fn.__name__, fn.__module__, sig, consts, attrs, opts])
    assert len(jobs) == 12, [j[0] for j in jobs]
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _COMPILE], input=json.dumps(jobs), env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert len(lines) == 12, done.stdout
    # An H100 / H200 gives a block at most 227 KiB of shared memory (Triton refuses a larger launch).
    assert max(int(line.split()[-4]) for line in lines) <= 227 * 1024, done.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the script runs for minutes")
def test_gpu_check_says_it_needs_a_gpu():
    import subprocess
    import sys
    from pathlib import Path
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "sees no CUDA GPU" in done.stderr, done.stderr[-2000:]
