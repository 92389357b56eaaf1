"""The hand-written CPU kernels against plain torch."""
import pytest
import torch
import torch.nn.functional as F

from pagedserve.kernels import cpu


def test_kernels_compile_here():
    """CI machines have g++: the compiled kernels must be what the CPU paths run."""
    assert cpu.load() is not None


@pytest.mark.parametrize("rows", [1, 2, 5, 8])
@pytest.mark.parametrize("n,k", [(576, 576), (100, 45), (1728, 1536), (33, 32)])
@pytest.mark.parametrize("bias", [False, True])
def test_small_bf16_linear_equals_float_reference(rows, n, k, bias):
    g = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=g).bfloat16()
    w = (torch.randn(n, k, generator=g) / k ** 0.5).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    out = cpu.linear(x, w, b)
    ref = F.linear(x.double(), w.double(), None if b is None else b.double())
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    # Products are exact, sums are float32: only the final rounding to bf16 differs.
    torch.testing.assert_close(out.double(), ref, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out.float(), F.linear(x, w, b).float(), atol=2e-2, rtol=2e-2)


def test_linear_falls_back_for_other_shapes_and_dtypes():
    x = torch.randn(20, 64)
    w = torch.randn(32, 64)
    torch.testing.assert_close(cpu.linear(x, w), F.linear(x, w))
    xb, wb = x.bfloat16(), w.bfloat16()
    torch.testing.assert_close(cpu.linear(xb, wb), F.linear(xb, wb))     # 20 rows: torch's GEMM
