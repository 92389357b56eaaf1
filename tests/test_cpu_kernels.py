"""The hand-written CPU kernels against plain torch."""
import pytest
import torch
import torch.nn.functional as F

from pagedserve.kernels import cpu


def test_kernels_compile_here():
    """CI machines have g++: the compiled kernels must be what the CPU paths run, the best
    variant this CPU supports unless $PAGEDSERVE_CPU_KERNELS forces one."""
    assert cpu.load() is not None
    assert cpu.variant() == cpu.choose_variant()
    assert cpu.supported_variants()[-1] == "scalar"


def test_each_variant_runs_its_own_code_paths(kernel_variant):
    """A forced variant is really that build: the library reports the vector paths that the
    compiler's target flags enabled."""
    assert cpu.variant() == kernel_variant
    assert cpu.load().kernel_variant().decode() == f"{kernel_variant} ({kernel_variant} paths)"


def test_forcing_a_variant_the_cpu_lacks_is_refused(monkeypatch):
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset({"sse2", "avx2", "fma", "f16c"}))
    monkeypatch.setenv(cpu.ENV_VARIANT, "avx512bf16")
    with pytest.raises(RuntimeError, match="lacks avx512_bf16, avx512bw, avx512dq, avx512f, avx512vl"):
        cpu.choose_variant()
    monkeypatch.setenv(cpu.ENV_VARIANT, "avx3")
    with pytest.raises(ValueError, match="avx512bf16, avx512, avx2, scalar"):
        cpu.choose_variant()
    monkeypatch.setenv(cpu.ENV_VARIANT, "auto")
    assert cpu.choose_variant() == "avx2"
    monkeypatch.delenv(cpu.ENV_VARIANT)
    assert cpu.choose_variant() == "avx2"


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 37])
@pytest.mark.parametrize("n,k", [(576, 576), (100, 46), (1728, 1536), (33, 32), (7, 2)])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_bf16_linear_equals_float_reference(kernel_variant, rows, n, k, bias):
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) / k ** 0.5).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    packed = cpu.pack_weight(w)
    assert isinstance(packed, cpu.PackedWeight)
    out = cpu.linear(x, packed, b)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    # Products are exact, sums are float32: only the final rounding to bf16 differs.
    torch.testing.assert_close(out.double(), ref, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out.float(), F.linear(x, w, b).float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("rows", [1, 5, 9, 64])
@pytest.mark.parametrize("n,k", [(50, 96), (576, 576), (33, 7)])
def test_packed_float32_linear_equals_torch(kernel_variant, rows, n, k):
    x, w, b = torch.randn(rows, k), torch.randn(n, k), torch.randn(n)
    packed = cpu.pack_weight(w)
    assert isinstance(packed, cpu.PackedWeight)
    torch.testing.assert_close(cpu.linear(x, packed, b), F.linear(x, w, b), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(cpu.linear(x, packed), F.linear(x, w), atol=1e-4, rtol=1e-5)


def test_plain_and_odd_width_weights_use_torch():
    x, w = torch.randn(20, 64), torch.randn(32, 64)
    torch.testing.assert_close(cpu.linear(x, w), F.linear(x, w))
    xo, wo = torch.randn(3, 63).bfloat16(), torch.randn(8, 63).bfloat16()   # odd K: no bf16 pairs
    assert cpu.pack_weight(wo) is wo
    torch.testing.assert_close(cpu.linear(xo, wo), F.linear(xo, wo))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,width", [(1, 576), (7, 100), (300, 576)])
def test_fused_add_rms_norm_equals_torch(kernel_variant, dtype, rows, width):
    g = torch.Generator().manual_seed(rows + width)
    x, y = torch.randn(rows, width, generator=g).to(dtype), torch.randn(rows, width, generator=g).to(dtype)
    w = torch.randn(width, generator=g).to(dtype)
    expected_x = x + y
    expected = w * torch.nn.functional.rms_norm(expected_x.float(), (width,), eps=1e-5).to(dtype)
    normed = cpu.add_rms_norm(x, y, w, 1e-5)           # updates x in place
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(x, expected_x, atol=0, rtol=0)
    torch.testing.assert_close(normed, expected, **tol)
    torch.testing.assert_close(cpu.add_rms_norm(x, None, w, 1e-5), expected, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,width", [(1, 1536), (5, 40), (129, 1536)])
def test_fused_silu_and_mul_equals_torch(kernel_variant, dtype, rows, width):
    gate_up = (torch.randn(rows, 2 * width, generator=torch.Generator().manual_seed(rows)) * 6).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(cpu.silu_and_mul(gate_up), F.silu(gate) * up, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 9, 300])
def test_rope_in_place_equals_reference(kernel_variant, dtype, rows):
    from pagedserve.models.layers import RotaryEmbedding, apply_rope
    heads, kv_heads, head_dim = 6, 2, 64
    g = torch.Generator().manual_seed(rows)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    rope = RotaryEmbedding(head_dim, 4096, 10000.0, None, dtype)
    cos, sin = rope.lookup(torch.randint(0, 4096, (rows,), generator=g))
    rotated = (heads + kv_heads) * head_dim
    expected = apply_rope(qkv[:, :rotated].reshape(rows, -1, head_dim), cos, sin)
    untouched = qkv[:, rotated:].clone()
    assert cpu.rope_inplace(qkv, heads + kv_heads, head_dim, cos.view(rows, -1), sin.view(rows, -1))
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(qkv[:, :rotated].reshape(rows, -1, head_dim), expected, **tol)
    torch.testing.assert_close(qkv[:, rotated:], untouched, atol=0, rtol=0)


@pytest.mark.parametrize("rows, cols", [(1, 7), (3, 16), (5, 49152), (64, 1000), (2, 33)])
def test_argmax_rows_equals_torch(kernel_variant, rows, cols):
    g = torch.Generator().manual_seed(rows * cols)
    x = torch.randn(rows, cols, generator=g)
    # Ties (the first one wins), a row of -inf, a NaN (it counts as the maximum), a maximum in
    # the scalar tail past the last group of 16.
    x[0, cols // 2] = x[0, cols - 1] = 10.0
    if rows > 1:
        x[1] = float("-inf")
    if rows > 2:
        x[2, cols // 3] = float("nan")
        x[2, cols - 1] = float("nan")
    if rows > 3:
        x[3, cols - 1] = 50.0
    assert torch.equal(cpu.argmax_rows(x), x.max(dim=-1).indices)
    assert torch.equal(cpu.argmax_rows(x.bfloat16()), x.bfloat16().max(dim=-1).indices)   # torch path
