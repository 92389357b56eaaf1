"""PagedAttention (torch backend) against dense causal attention on random inputs."""
import math
import random

import pytest
import torch

from pagedserve.attention.cpu_backend import CpuAttention
from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.attention.torch_backend import TorchAttention
from pagedserve.kernels import cpu

BACKENDS = {"torch": TorchAttention, "cpu": CpuAttention}


def test_cpu_kernel_compiles_here():
    """CI machines have g++: the compiled kernel must be what the CPU backend runs."""
    assert CpuAttention().lib is not None


def dense_reference(q, k, v, scale):
    """q: [Lq, Hq, D] for the last Lq positions of k, v: [L, Hkv, D]; plain softmax attention."""
    lq, L = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    causal = torch.arange(L)[None, :] > torch.arange(L - lq, L)[:, None]
    scores.masked_fill_(causal, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double()).to(q.dtype)


def make_batch(specs, block_size, num_kv_heads, head_dim, num_heads, num_blocks, seed=0):
    """specs: list of (context_len_before, new_tokens). Decodes (new == 1) must come first.
    Returns the KV cache with the old context already written, the step's q/k/v, metadata
    and, per sequence, the full k/v history for the reference."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    free = list(range(num_blocks))
    rng.shuffle(free)            # scattered, out-of-order physical blocks
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=g)
    qs, ks, vs, slots, qsl, lens, tables, history = [], [], [], [], [0], [], [], []
    for ctx, new in specs:
        total = ctx + new
        table = [free.pop() for _ in range(math.ceil(total / block_size))]
        old_k = torch.randn(ctx, num_kv_heads, head_dim, generator=g)
        old_v = torch.randn(ctx, num_kv_heads, head_dim, generator=g)
        for p in range(ctx):
            cache[0, table[p // block_size], p % block_size] = old_k[p]
            cache[1, table[p // block_size], p % block_size] = old_v[p]
        k = torch.randn(new, num_kv_heads, head_dim, generator=g)
        v = torch.randn(new, num_kv_heads, head_dim, generator=g)
        qs.append(torch.randn(new, num_heads, head_dim, generator=g))
        ks.append(k)
        vs.append(v)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(ctx, total)]
        qsl.append(qsl[-1] + new)
        lens.append(total)
        tables.append(table)
        history.append((torch.cat([old_k, k]), torch.cat([old_v, v])))
    width = max(map(len, tables))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(qsl), seq_lens=torch.tensor(lens),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        num_decodes=sum(1 for _, n in specs if n == 1), query_start_loc_cpu=qsl, seq_lens_cpu=lens,
        max_seq_len=max(lens))
    return cache, torch.cat(qs), torch.cat(ks), torch.cat(vs), meta, history


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("head_major", [False, True])
def test_paged_attention_equals_dense(backend, block_size, num_heads, num_kv_heads, head_major):
    head_dim = 32
    # Decodes first (context, 1 new), then prefills with and without cached context.
    specs = [(0, 1), (5, 1), (40, 1), (77, 1), (300, 1), (600, 1), (0, 13), (9, 7), (31, 1 + 31), (64, 20)]
    cache, q, k, v, meta, history = make_batch(specs, block_size, num_kv_heads, head_dim, num_heads,
                                               num_blocks=1500 // block_size + 64)
    if head_major:       # the CPU runner's storage: [2, blocks, Hkv, block_size, D] seen as the usual shape
        cache = cache.transpose(2, 3).contiguous().transpose(2, 3)
    scale = head_dim ** -0.5
    out = BACKENDS[backend]().forward(q, k, v, cache, meta, scale)
    for i, (ctx, new) in enumerate(specs):
        s, e = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
        ref = dense_reference(q[s:e], *history[i], scale)
        torch.testing.assert_close(out[s:e], ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("head_major", [False, True])
def test_new_keys_and_values_land_in_their_slots(backend, head_major):
    cache, q, k, v, meta, history = make_batch([(3, 1), (0, 6)], 4, 2, 8, 2, num_blocks=16)
    if head_major:
        cache = cache.transpose(2, 3).contiguous().transpose(2, 3)
    k, v = torch.cat([k, k], dim=1)[:, 2:], torch.cat([v, v], dim=1)[:, :2]   # row-strided views, as the model passes
    BACKENDS[backend]().forward(q, k, v, cache, meta, 1.0)
    blocks, offsets = meta.slot_mapping // 4, meta.slot_mapping % 4
    torch.testing.assert_close(cache[0][blocks, offsets], k)
    torch.testing.assert_close(cache[1][blocks, offsets], v)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_bfloat16_is_close(backend):
    specs = [(10, 1), (50, 1), (400, 1), (0, 20), (17, 9)]
    cache, q, k, v, meta, history = make_batch(specs, 16, 2, 64, 6, num_blocks=80)
    out = BACKENDS[backend]().forward(q.bfloat16(), k.bfloat16(), v.bfloat16(), cache.bfloat16(), meta, 0.125)
    for i in range(len(specs)):
        s, e = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
        ref = dense_reference(q[s:e], *history[i], 0.125)
        torch.testing.assert_close(out[s:e].float(), ref, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("specs", [[(3000, 1)], [(2100, 1)] * 20, [(1500, 1), (700, 40)]],
                         ids=["one-long-decode", "many-long-decodes", "long-prefill-chunk"])
def test_long_contexts_split_and_merged(specs):
    """Contexts longer than a partition (256 tokens) are split and the partial softmaxes merged;
    with few queries, with many, and for prefill tokens whose prefixes straddle partitions."""
    cache, q, k, v, meta, history = make_batch(specs, 16, 2, 64, 6, num_blocks=sum((c + n) // 16 + 1 for c, n in specs) + 8)
    out = CpuAttention().forward(q, k, v, cache, meta, 0.125)
    for i in range(len(specs)):
        s, e = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
        torch.testing.assert_close(out[s:e], dense_reference(q[s:e], *history[i], 0.125), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (8, 1, 64), (4, 4, 128), (6, 2, 32), (3, 1, 80)])
def test_tiled_prefill_equals_dense(kernel_variant, dtype, block_size, num_heads, num_kv_heads, head_dim):
    """Prefill chunks go through the tiled kernel (a chunk's query rows in parts of up to 64 rows or
    16 tokens, whichever is more, bf16 dots and float32 alike, x 32 keys at a time, online
    softmax): chunks shorter and longer than a part, split evenly (70 tokens: two of 35 at G = 1),
    with and without a long cached context, after decode rows. Without the per-token view the kernel has no fallback, so a result proves the
    tiled path ran. (bf16 at head dim 80 has none with AVX512-BF16: its tiles need D % 32.)"""
    if kernel_variant not in cpu.TILED_PREFILL_VARIANTS:
        pytest.skip(f"the {kernel_variant} kernels have no tiled prefill (prefill tokens use the decode kernel)")
    if kernel_variant == "avx512bf16" and dtype == torch.bfloat16 and head_dim % 32:
        pytest.skip("the bf16 dot-product tiles take head dims that are multiples of 32")
    specs = [(5, 1), (300, 1), (0, 1), (0, 100), (37, 50), (300, 33), (15, 17), (0, 3), (600, 70)]   # decodes first
    cache, q, k, v, meta, history = make_batch(specs, block_size, num_kv_heads, head_dim, num_heads,
                                               num_blocks=1900 // block_size + 64)
    cache = cache.to(dtype).transpose(2, 3).contiguous().transpose(2, 3)    # head-major, as the CPU runner
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    cpu.write_kv(cache, k, v, meta.slot_mapping)
    rows = cpu.AttentionRows.of(meta.block_tables, meta.seq_lens, meta.query_start_loc, meta.num_decodes, None)
    scale = head_dim ** -0.5
    out = cpu.paged_attention(q, cache, rows, scale)
    assert out is not None
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for i in range(len(specs)):
        s, e = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
        hk, hv = (t.to(dtype).float() for t in history[i])
        torch.testing.assert_close(out[s:e].float(), dense_reference(q[s:e].float(), hk, hv, scale), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(6, 2, 32), (9, 3, 64), (4, 4, 128), (8, 1, 256), (3, 1, 80), (2, 1, 48)])
def test_each_kernel_variant_equals_dense(kernel_variant, dtype, num_heads, num_kv_heads, head_dim):
    """Every CPU kernel variant this CPU runs (AVX-512 with and without BF16, AVX2, scalar):
    decode rows, prefill chunks, contexts over a partition, in both storage types; head dims
    with a vector path and one without (48: the scalar loops)."""
    specs = [(0, 1), (5, 1), (40, 1), (300, 1), (600, 1), (0, 13), (9, 7), (31, 32), (64, 20)]
    cache, q, k, v, meta, history = make_batch(specs, 16, num_kv_heads, head_dim, num_heads, num_blocks=150)
    cache = cache.to(dtype).transpose(2, 3).contiguous().transpose(2, 3)   # head-major, as the CPU runner
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    scale = head_dim ** -0.5
    out = CpuAttention().forward(q, k, v, cache, meta, scale)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for i in range(len(specs)):
        s, e = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
        hk, hv = (t.to(dtype).float() for t in history[i])
        torch.testing.assert_close(out[s:e].float(), dense_reference(q[s:e].float(), hk, hv, scale), **tol)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (8, 1), (8, 8)])
def test_a_decode_row_is_the_same_alone_and_in_any_batch(num_heads, num_kv_heads):
    """A decode row's context splits into partitions by its own length only (split over threads:
    3 KV heads on 2 threads take 2 parts each), so its output is the same bit for bit alone and
    beside any other rows (batch-invariant greedy output); and close to dense attention."""
    lengths = [40, 64, 127, 128, 200, 300, 513, 1100]
    specs = [(n - 1, 1) for n in lengths]
    cache, q, k, v, meta, history = make_batch(specs, 16, num_kv_heads, 64, num_heads, num_blocks=200)
    cache = cache.transpose(2, 3).contiguous().transpose(2, 3)     # head-major, as the CPU runner
    cpu.write_kv(cache, k, v, meta.slot_mapping)
    together = cpu.paged_decode_attention(q, cache, meta.block_tables, meta.seq_lens, 0.125)
    for i in range(len(specs)):
        alone = cpu.paged_decode_attention(q[i:i + 1], cache, meta.block_tables[i:i + 1], meta.seq_lens[i:i + 1], 0.125)
        assert torch.equal(alone, together[i:i + 1]), f"length {lengths[i]}"
        torch.testing.assert_close(alone[0], dense_reference(q[i:i + 1], *history[i], 0.125)[0], atol=1e-5, rtol=1e-5)
    mixed = [5, 0, 2]
    sub = cpu.paged_decode_attention(q[mixed], cache, meta.block_tables[mixed], meta.seq_lens[mixed], 0.125)
    assert torch.equal(sub, together[mixed])
