"""The AMX-BF16 path with the weights as A tiles (quant_kernels.cpp amxw_linear, taken by
quant_linear_tiles for bf16 x of quant.amxw_rows() rows where quant.amxw_in_use()): bit for bit the
packed tiles it replaces (the same bf16 weights, the same float32 sums), the float product of the
same bf16 values, every type, groups of 32 weight rows with partial ones, activation tiles of 16
with partial ones, row counts around each threshold, strided rows. Skipped where the CPU (or its
kernel) gives no AMX-BF16, or the avx512vnni build is not there."""
from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import cpu, quant
from tests.test_quant_kernels import weight


@pytest.fixture
def amxw():
    """The avx512vnni variant with the weights-as-A path on for 1..300 rows (restored after)."""
    if "avx512vnni" not in quant.supported_variants():
        pytest.skip("this CPU lacks AVX512-VNNI (the AMX paths live in that build)")
    with quant.using_variant("avx512vnni"), cpu.using_amx(True), quant.using_amxw(True, (1, 300)) as on:
        if not on:
            pytest.skip(f"no AMX-BF16 here ({cpu.describe_amx()})")
        yield


def _cols(qtype: str) -> int:
    """Columns with a group of 16 blocks and a tail (32-element types), or 5 super-blocks."""
    return 1056 if quant.BLOCK[qtype] == 32 else 1280


def _packed(x, parts, bias):
    with quant.using_amxw(False):
        return quant._linear_tiles(x, parts, bias, quant.load())


@pytest.mark.parametrize("qtype", quant.QTYPES)
@pytest.mark.parametrize("tokens", [1, 8, 17, 33, 48])
def test_amxw_equals_packed_tiles(amxw, qtype, tokens):
    """Two parts stacked (37 and 21 rows: partial groups of 32 and of 16), bias: exactly the packed
    tiles' result, and the float64 product of the same bf16 values up to float32 sums."""
    w, _ = weight(qtype, cols=_cols(qtype))
    w2, _ = weight(qtype, rows=21, cols=w.shape[1], seed=1)
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, w.shape[1], generator=g).bfloat16()
    bias = torch.randn(w.shape[0] + w2.shape[0], generator=g)
    y = quant._linear_tiles(x, [w, w2], bias, quant.load())
    assert torch.equal(y, _packed(x, [w, w2], bias))
    full = torch.cat([quant.dequantize_torch(w), quant.dequantize_torch(w2)]).bfloat16()
    ref = x.double() @ full.double().T + bias.double()
    assert ((y.double() - ref).abs() <= ref.abs() * 2 ** -8 + 1e-4).all()


@pytest.mark.parametrize("qtype", ["q4_0", "q6_k"])
def test_amxw_types_mixed_and_strided(amxw, qtype):
    """Parts of three types under one call, one of them a slice of columns (rows strided: no
    prefetch of the next group), 64 weight rows (whole groups) and 70 activation rows."""
    wide, _ = weight("q8_0", rows=64, cols=2 * _cols("q4_k"), seed=3)
    parts = [weight("q4_k", rows=40, cols=_cols("q4_k"))[0], quant.slice_cols(wide, 0, _cols("q4_k")),
             weight(qtype, rows=33, cols=_cols("q4_k"), seed=2)[0]]
    x = torch.randn(70, _cols("q4_k"), generator=torch.Generator().manual_seed(5)).bfloat16()
    y = quant._linear_tiles(x, parts, None, quant.load())
    assert torch.equal(y, _packed(x, parts, None))


def test_the_thresholds(amxw):
    """Shipped: bf16 x from AMXW_MIN_ROWS rows on this path (the integer dots stop below it, decode
    batches and prefill chunks alike), packed tiles above AMXW_MAX_ROWS; float32 x never."""
    with quant.using_amxw(None):
        assert quant.amxw_in_use()
        first, last = quant.amxw_rows()
        assert quant.batch_rows(decode=True, bf16=True) == quant.batch_rows(bf16=True) == first - 1
        assert quant.batch_rows(decode=True) == quant.batch_rows(True, bf16=False)     # float32: as before
        w, _ = weight("q4_0", cols=_cols("q4_0"))
        for tokens in (first - 1, first, last, last + 1):
            x = torch.randn(tokens, w.shape[1], generator=torch.Generator().manual_seed(tokens)).bfloat16()
            y = quant.linear(x, w, decode=True)
            if tokens >= first:
                assert torch.equal(y, _packed(x, [w], None))
            else:
                assert torch.equal(y, quant._linear_small(x, [w], None, quant.load()))
    with cpu.using_amx(False):
        assert not quant.amxw_in_use()        # follows cpu.py's AMX switch
    assert "quant_amxw" in quant.describe()


@pytest.mark.parametrize("qtype", quant.QTYPES)
def test_fused_tiles_above_the_amxw_rows(amxw, qtype):
    """Past amxw_rows() (here from 5 rows), bf16 x takes the packed tiles packed and multiplied per
    thread (blocks of about 512 KiB: a part of 300 rows spans two): exactly the packed tiles."""
    cols = _cols(qtype)
    parts = [weight(qtype, rows=r, cols=cols, seed=i)[0] for i, r in enumerate((37, 21, 300))]
    x = torch.randn(40, cols, generator=torch.Generator().manual_seed(7)).bfloat16()
    bias = torch.randn(358, generator=torch.Generator().manual_seed(8))
    with quant.using_amxw(True, (1, 4)):
        y = quant._linear_tiles(x, parts, bias, quant.load())
    assert torch.equal(y, _packed(x, parts, bias))


@pytest.mark.parametrize("qtype", ["q4_0", "q8_0", "q4_k", "q6_k"])
@pytest.mark.parametrize("tokens", [1, 16, 40, 100])
def test_amxw_two_groups_per_lone_tile(amxw, qtype, tokens):
    """A lone (or last, odd) tile of x takes two whole groups of 32 weight rows per pass (four C
    tiles): 100 rows (three whole groups and a partial one), bias: exactly the packed tiles."""
    w, _ = weight(qtype, rows=100, cols=_cols(qtype), seed=4)
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, w.shape[1], generator=g).bfloat16()
    bias = torch.randn(100, generator=g)
    assert torch.equal(quant._linear_tiles(x, [w], bias, quant.load()), _packed(x, [w], bias))
