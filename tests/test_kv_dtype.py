"""The 8-bit KV cache (kv_cache_dtype: fp8 = fp8_e4m3, fp8_e5m2, int8), kernel level: the write
kernel quantizes bit-exactly as attention/kv_format.py's torch reference; every kernel variant's
decode and prefill attention over 8-bit blocks equals exact attention over the dequantized
values (and is close to attention over the 16-bit values); the torch backend agrees."""
import pytest
import torch

from pagedserve.attention.cpu_backend import CpuAttention
from pagedserve.attention.kv_format import FORMATS, kv_format
from pagedserve.attention.torch_backend import TorchAttention
from pagedserve.kernels import cpu
from tests.test_attention import dense_reference, make_batch

QUANTIZED = ["fp8_e4m3", "fp8_e5m2", "int8"]


def test_fp8_means_e4m3_and_unknown_names_are_refused():
    assert kv_format("fp8") is FORMATS["fp8_e4m3"] and kv_format(None) is FORMATS["auto"]
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_format("fp4")


def test_row_bytes():
    """64-dim rows: 64 codes (e5m2) or 64 codes + a bf16 scale, against 128 bytes of bf16."""
    assert kv_format("fp8_e5m2").row_bytes(64, torch.bfloat16) == 64
    assert kv_format("int8").row_bytes(64, torch.bfloat16) == kv_format("fp8").row_bytes(64, torch.float32) == 66
    assert kv_format("auto").row_bytes(64, torch.bfloat16) == 128
    assert kv_format("auto").row_bytes(64, torch.float32) == 256


def quantized_cache(fmt, cache):
    """The float cache [2, blocks, B, Hkv, D] in `fmt`, head-major as the CPU runner stores it."""
    return fmt.quantize(cache).transpose(2, 3).contiguous().transpose(2, 3)


@pytest.mark.parametrize("name", QUANTIZED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kernel_quantizes_as_the_reference(kernel_variant, name, dtype):
    """Bit for bit, on values spanning the formats' ranges: tiny (subnormal codes), huge
    (saturating), exact zeros (an all-zero row: scale 0), ties."""
    fmt = kv_format(name)
    g = torch.Generator().manual_seed(1)
    T, H, D = 37, 3, 64
    k = torch.randn(T, H, D, generator=g) * torch.logspace(-9, 6, T)[:, None, None]
    v = torch.randn(T, H, D, generator=g)
    k[3] = 0.0
    v[4, 1, :8] = torch.tensor([0.5, 1.5, 2.5, -0.0625, 448.0, 57344.0, 1e30, -1e30])
    k, v = k.to(dtype), v.to(dtype)
    cache = torch.zeros(2, 12, 4, H, fmt.row_elements(D), dtype=torch.uint8).transpose(2, 3).contiguous().transpose(2, 3)
    slots = torch.randperm(48, generator=g)[:T]
    assert cpu.write_kv(cache, k, v, slots, fmt.code)
    blocks, offsets = slots // 4, slots % 4
    assert torch.equal(cache[0][blocks, offsets], fmt.quantize(k))
    assert torch.equal(cache[1][blocks, offsets], fmt.quantize(v))
    if name == "fp8_e5m2":       # no scale: values it represents come back exactly
        back = fmt.dequantize(cache[1][blocks, offsets], D)
        assert back[4, 1, :6].tolist() == [0.5, 1.5, 2.5, -0.0625, 448.0, 57344.0]


def attend_8bit(fmt, specs, num_heads, num_kv_heads, head_dim, dtype, per_token=True, seed=0):
    """The CPU kernel over an 8-bit cache holding the old context (quantized by the reference),
    after writing the step's k, v with the write kernel; and the exact reference: dense
    attention over the dequantized history, and over the unquantized one."""
    cache, q, k, v, meta, history = make_batch(specs, 16, num_kv_heads, head_dim, num_heads,
                                               num_blocks=sum((c + n) // 16 + 1 for c, n in specs) + 8, seed=seed)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    cache8 = quantized_cache(fmt, cache.to(dtype))     # the old context as the model would have written it
    assert cpu.write_kv(cache8, k, v, meta.slot_mapping, fmt.code)
    prefills = meta.num_decodes < meta.num_seqs
    rows = cpu.AttentionRows.of(meta.block_tables, meta.seq_lens, meta.query_start_loc, meta.num_decodes,
                                meta.per_token if prefills and per_token else None)
    scale = head_dim ** -0.5
    out = cpu.paged_attention(q, cache8, rows, scale, fmt.code)
    refs, floats = [], []
    for i in range(len(specs)):
        s, e = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
        hk, hv = (t.to(dtype).float() for t in history[i])
        dk, dv = fmt.dequantize(fmt.quantize(hk), head_dim), fmt.dequantize(fmt.quantize(hv), head_dim)
        refs.append(dense_reference(q[s:e].float(), dk, dv, scale))
        floats.append(dense_reference(q[s:e].float(), hk, hv, scale))
    return out, meta, refs, floats


SPECS = [(0, 1), (5, 1), (40, 1), (300, 1), (600, 1), (0, 13), (9, 7), (31, 32), (64, 20)]


@pytest.mark.parametrize("name", QUANTIZED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(6, 2, 32), (9, 3, 64), (4, 4, 128), (3, 1, 80),
                                                             (2, 1, 48)])
def test_each_variant_attends_over_8bit_blocks(kernel_variant, name, dtype, num_heads, num_kv_heads, head_dim):
    """Decode rows, prefill chunks and contexts over a partition on every kernel variant, head
    dims with each vector path and one without (48): equal to exact attention over the
    dequantized values; close to attention over the 16-bit ones."""
    fmt = kv_format(name)
    out, meta, refs, floats = attend_8bit(fmt, SPECS, num_heads, num_kv_heads, head_dim, dtype)
    assert out is not None
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for i, (ref, flt) in enumerate(zip(refs, floats)):
        s, e = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
        torch.testing.assert_close(out[s:e].float(), ref, **tol)
        bound = 0.08 if name == "fp8_e5m2" else 0.04    # unit-variance values; e5m2 has 2 mantissa bits
        assert (out[s:e].float() - flt).abs().mean() < bound


@pytest.mark.parametrize("name", QUANTIZED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_prefill_reads_8bit_blocks(kernel_variant, name, dtype):
    """Without the per-token view the prefill chunks can only go through the tiled kernel."""
    if kernel_variant not in cpu.TILED_PREFILL_VARIANTS:
        pytest.skip(f"the {kernel_variant} kernels have no tiled prefill")
    fmt = kv_format(name)
    specs = [(5, 1), (300, 1), (0, 100), (37, 50), (300, 33), (0, 3)]
    out, meta, refs, _ = attend_8bit(fmt, specs, 8, 2, 64, dtype, per_token=False, seed=3)
    assert out is not None
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for i, ref in enumerate(refs):
        s, e = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
        torch.testing.assert_close(out[s:e].float(), ref, **tol)


@pytest.mark.parametrize("name", QUANTIZED)
def test_torch_backend_is_the_reference_of_the_cpu_backend(name):
    """The same step through both backends (each writes the step's k, v its own way)."""
    specs = [(7, 1), (260, 1), (0, 9), (20, 12)]
    cache, q, k, v, meta, _ = make_batch(specs, 16, 2, 64, 6, num_blocks=40)
    fmt = kv_format(name)
    cache_cpu = quantized_cache(fmt, cache)
    cache_torch = fmt.quantize(cache)
    out_cpu = CpuAttention(name).forward(q, k, v, cache_cpu, meta, 0.125)
    out_torch = TorchAttention(name).forward(q, k, v, cache_torch, meta, 0.125)
    assert torch.equal(cache_cpu, cache_torch)        # the same codes and scales in every slot
    torch.testing.assert_close(out_cpu, out_torch, atol=2e-5, rtol=2e-5)
