"""kernels/quant.py's decode path (quant_linear_small at a few rows): the activations it
quantizes inside the call are exactly quant.quantize_activations' (read back through an identity
weight), on every variant this CPU builds, for float32 and bf16 inputs, across the rows both
threads take (each prefetching past its range's and the matrix's end)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedserve.kernels import quant


@pytest.fixture(params=quant.supported_variants())
def variant(request):
    with quant.using_variant(request.param) as lib:
        assert lib is not None, f"variant {request.param} did not build"
        yield request.param


def identity_q8_0(n: int) -> quant.QuantizedWeight:
    """An n x n q8_0 identity: row i holds code 1 at column i, every scale 1.0."""
    blocks = np.zeros((n, n // 32, 34), dtype=np.uint8)
    blocks[..., 0:2] = np.array([1.0], dtype=np.float16).view(np.uint8)
    rows = np.arange(n)
    blocks[rows, rows // 32, 2 + rows % 32] = 1
    return quant.from_gguf_blocks("q8_0", torch.from_numpy(blocks.reshape(n, -1)), (n, n))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 2, 5])
def test_activations_quantized_exactly(variant, dtype, tokens):
    """y = x @ I.T reads back each activation as (1.0 * d) * q: the kernel's d and q equal
    quantize_activations' (one off by a step of q would miss by d, far from float rounding).
    1184 = 37 blocks: groups of 16 and a tail; 1184 rows: many pairs per thread."""
    n = 1184
    w = identity_q8_0(n)
    g = torch.Generator().manual_seed(tokens)
    x = (torch.randn(tokens, n, generator=g) * torch.logspace(-3, 2, n // 32).repeat_interleave(32)).to(dtype)
    x[0, :32] = 0                                        # an all-zero block: d = 0, q = 0
    y = quant.linear(x, w, decode=True)
    q, d = quant.quantize_activations(x.float())
    expected = (q.float().view(tokens, -1, 32) * d.float().view(tokens, -1, 1)).view(tokens, n)
    assert torch.equal(y, expected.to(dtype))


@pytest.mark.parametrize("qtype", ["q4_0", "q4_1", "q8_0", "q4_k", "q6_k"])
def test_one_token_rows_at_every_offset(variant, qtype):
    """T = 1 over row counts that end a pass, a thread's range or the matrix at every offset of
    a pair (the kernels prefetch rows ahead, past the end): each row equals its own product."""
    from tests.test_quant_kernels import weight
    cols = 32 * 40 if quant.BLOCK[qtype] == 32 else 256 * 4
    w, _ = weight(qtype, rows=23, cols=cols, seed=3)
    x = torch.randn(1, cols, generator=torch.Generator().manual_seed(4))
    for rows in (1, 2, 3, 22, 23):
        part = quant.slice_rows(w, 23 - rows, 23)            # ends at the matrix's last byte
        y = quant.linear(x, part, decode=True)
        singles = torch.cat([quant.linear(x, quant.slice_rows(part, r, r + 1)) for r in range(rows)], dim=1)
        scale = x.abs() @ quant.dequantize_torch(part).abs().T
        assert ((y - singles).abs() <= 1e-5 * scale + 1e-6).all()
