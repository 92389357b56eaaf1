"""The integer GEMM over r8 layouts (csrc/quant/gemm_r8_256.h: from 8 activation rows on the avx2 and
avxvnni variants): against the float64 reference of the same 8-bit activations (quant.reference_linear)
and bit for bit against the scalar build's arithmetic, at every number of rows 1..70 (the 64-row
tiles' edges, odd tails), several parts of different types in one product, bias, bf16 in and out;
and every row alone equal to it in the batch (batch invariance). Skips where the CPU has neither."""
import numpy as np
import pytest
import torch

from pagedserve.kernels import quant
from tests.test_quant_kernels import _check_small, weight
from tests.test_quant_r8_256 import act_block, r8_of

VECTOR = [v for v in ("avx2", "avxvnni", "vnni256") if v in quant.supported_variants()]
pytestmark = pytest.mark.skipif(not VECTOR, reason="no avx2 / avxvnni here")


@pytest.mark.parametrize("qtypes,cols", [(("q4_0",), 96), (("q4_1",), 160), (("q4_k",), 512), (("q5_k",), 256),
                                         (("q6_k",), 768), (("q4_k", "q6_k", "q4_1"), 256), (("q8_0", "q4_0"), 64),
                                         (("q5_0",), 96), (("q5_0", "q4_k"), 256), (("q8_0",), 256),
                                         (("q4_k", "q8_0"), 256)])
def test_gemm_equals_the_scalar_arithmetic_at_every_row_count(qtypes, cols):
    ws = [weight(q, rows=rows, cols=cols, seed=i)[0] for i, (q, rows) in enumerate(zip(qtypes, (24, 8, 16)))]
    rs = [r8_of(w) for w in ws]
    splits = [w.shape[0] for w in ws]
    bias = torch.randn(sum(splits), generator=torch.Generator().manual_seed(5))
    x = torch.randn(70, cols, generator=torch.Generator().manual_seed(7)) * 3
    with quant.using_variant("scalar") as lib:
        ref = quant._linear_small(x, rs, bias, lib, torch.float32)       # one row at a time (4-row passes)
    for T in list(range(1, 20)) + [31, 33, 63, 64, 65, 70]:
        for t0 in {0, 70 - T}:
            for w, part, b in zip(ws, ref[t0:t0 + T].split(splits, dim=1), bias.split(splits)):
                _check_small(part, x[t0:t0 + T], w, b, act_block(w.qtype))
    for variant in VECTOR:
        with quant.using_variant(variant) as lib:
            for T in list(range(1, 20)) + [31, 33, 63, 64, 65, 70]:
                for t0 in {0, 70 - T}:
                    y = quant._linear_small(x[t0:t0 + T], rs, bias, lib, torch.float32)
                    assert torch.equal(y, ref[t0:t0 + T]), (variant, T, t0, (y - ref[t0:t0 + T]).abs().max())
            y16 = quant._linear_small(x.bfloat16(), rs, bias, lib, torch.bfloat16)
            assert torch.equal(y16, quant._linear_small(x.bfloat16(), rs, bias, lib, torch.float32).bfloat16())


@pytest.mark.parametrize("qtype", ["q4_k", "q8_0"])
def test_linear_takes_the_integer_path_for_any_batch_on_256_bit_variants(qtype):
    """linear() over r8 weights: decode batches and prefill chunks of any size on the integer path (the
    GEMM from 8 rows: each row the value it has alone), whether or not the step is batch-invariant;
    without the GEMM (gemm=False: an mxfp4r8 part) prefill chunks only in a batch-invariant step."""
    w, _ = weight(qtype, rows=32, cols=256)
    r = r8_of(w)
    x = torch.randn(300, 256, generator=torch.Generator().manual_seed(3))
    for variant in VECTOR:
        with quant.using_variant(variant):
            alone = torch.cat([quant.linear(x[t:t + 1], r, decode=True) for t in range(0, 300, 37)])
            assert quant.batch_rows(True, False, r8=True) >= 300
            assert quant.batch_rows(False, False, r8=True) < 300 <= quant.batch_rows(False, False, r8=True, gemm=True)
            assert torch.equal(quant.linear(x, r, decode=True)[::37], alone), variant
            assert torch.equal(quant.linear(x, r)[::37], alone), variant           # a plain step's prefill chunk
            quant.set_batch_invariant(True)
            try:
                assert quant.batch_rows(False, True, r8=True) >= 300
                assert torch.equal(quant.linear(x, r)[::37], alone), variant
            finally:
                quant.set_batch_invariant(False)


def test_each_build_starts_the_gemm_where_it_was_measured():
    """The compiled crossover (gemm_r8_256.h's kDenseGemmMinRows) is the one measured per variant:
    17 rows on vnni256, 8 on the other r8 builds."""
    for variant in VECTOR:
        with quant.using_variant(variant):
            assert quant.gemm_r8_min_rows() == (17 if variant == "vnni256" else 8), variant
            previous = quant.set_gemm_r8_min_rows(5)
            try:
                assert quant.gemm_r8_min_rows() == 5
            finally:
                quant.set_gemm_r8_min_rows(previous)
    with pytest.raises(ValueError):
        quant.set_gemm_r8_min_rows(0)


@pytest.mark.parametrize("qtype,cols", [("q4_0", 256), ("q4_k", 512), ("q8_0", 256)])
def test_a_row_is_the_same_on_either_side_of_the_gemm_crossover(qtype, cols):
    """Where the r8 GEMM starts (quant.set_gemm_r8_min_rows: the dots below it) never changes a
    row's bits: each row alone (the 1-row dot) equals it in calls of 7, 8, 33, 48 and 65 rows, with
    the crossover at the build's default, 1, 8, 33 and past every call (dots only)."""
    w, _ = weight(qtype, rows=24, cols=cols, seed=3)
    r = r8_of(w)
    x = torch.randn(65, cols, generator=torch.Generator().manual_seed(11)) * 2
    for variant in VECTOR:
        with quant.using_variant(variant) as lib:
            alone = torch.cat([quant._linear_small(x[t:t + 1], [r], None, lib, torch.float32) for t in range(65)])
            for first in (quant.gemm_r8_min_rows(), 1, 8, 33, 1 << 30):
                previous = quant.set_gemm_r8_min_rows(first)
                try:
                    for T in (7, 8, 33, 48, 65):
                        y = quant._linear_small(x[:T], [r], None, lib, torch.float32)
                        assert torch.equal(y, alone[:T]), (variant, first, T, (y - alone[:T]).abs().max())
                finally:
                    assert quant.set_gemm_r8_min_rows(previous) == first


@pytest.mark.parametrize("code,sign", [(0, 1.0), (63, -1.0), (0, -1.0), (63, 1.0)])
def test_q6_k_gemm_at_the_16_bit_limits(code, sign):
    """Every q6_k code at one end (q - 32 = -32 or 31) against activations all at +-127: the GEMM's
    16-bit sums of 8 products per lane (gemm_q6_rows) reach +-32512 and must still equal the dots
    (and the decode dots' 16-bit sums of 4, 32004, equal the scalar reference)."""
    rows, cols = 16, 512
    blocks = torch.zeros(rows, cols // 256, 210, dtype=torch.uint8)
    blocks[..., :192] = 0xFF if code == 63 else 0          # ql, qh: every code `code`
    blocks[..., 192:208] = torch.tensor([127, 128, 1, 255] * 4, dtype=torch.uint8)      # scales 127, -128, 1, -1
    blocks[..., 208:210] = torch.tensor([0x00, 0x3C], dtype=torch.uint8)                # d = 1.0
    w = r8_of(quant.from_gguf_blocks("q6_k", blocks.reshape(rows, -1), (rows, cols)))
    x = torch.full((16, cols), sign)
    with quant.using_variant("scalar") as lib:
        ref = quant._linear_small(x, [w], None, lib, torch.float32)
    assert ref.abs().min() > 0
    for variant in VECTOR:
        with quant.using_variant(variant) as lib:
            for T in (1, 4, 16):        # the decode dots (1-4 rows a pass) and the GEMM
                assert torch.equal(quant._linear_small(x[:T], [w], None, lib, torch.float32), ref[:T]), (variant, T)


@pytest.mark.parametrize("qtype,sign", [("q4_k", 1.0), ("q4_k", -1.0), ("q4_0", 1.0), ("q4_1", -1.0)])
def test_q4_gemm_at_the_16_bit_limits(qtype, sign):
    """Every code 15 against activations all at +-127: the GEMM's 16-bit lanes of 16 products
    (q4_dot8's two halves added in 16 bits) reach +-30480 and must still equal the dots (the decode
    dots' too: q4_k's vpdpbusd sums of 16 products packed to 16 bits, k_dot8_q4)."""
    rows, cols = 16, 512
    size = {"q4_k": 144, "q4_0": 18, "q4_1": 20}[qtype]
    per_row = cols // (256 if qtype == "q4_k" else 32)
    blocks = torch.full((rows, per_row, size), 0xFF, dtype=torch.uint8)     # codes 15 (q4_k: scales, minima 63)
    blocks[..., 0:2] = torch.tensor([0x00, 0x3C], dtype=torch.uint8)     # d = 1.0
    if qtype != "q4_0":
        blocks[..., 2:4] = torch.tensor([0x00, 0x38], dtype=torch.uint8)     # dmin / m = 0.5
    w = r8_of(quant.from_gguf_blocks(qtype, blocks.reshape(rows, -1), (rows, cols)))
    x = torch.full((16, cols), sign)
    with quant.using_variant("scalar") as lib:
        ref = quant._linear_small(x, [w], None, lib, torch.float32)
    assert ref.abs().min() > 0
    for variant in VECTOR:
        with quant.using_variant(variant) as lib:
            for T in (1, 4, 16):        # the decode dots (1-4 rows a pass) and the GEMM
                assert torch.equal(quant._linear_small(x[:T], [w], None, lib, torch.float32), ref[:T]), (variant, T)


def _q6_k_super_block_arithmetic(raw: np.ndarray, x: torch.Tensor) -> torch.Tensor:
    """q6_k's r8 arithmetic on the 256-bit and scalar builds (the spec, spelled out apart from the
    kernels): activations with one scale dk per 256 (quant.quantize_activations(x, 256)); per row
    and super-block the exact integer sum_i sc_i * sum_e (q_e - 32) x_e, then one float32
    fma(float(isum), d * dk, acc) a super-block, in order (float64 holds each product exactly)."""
    rows, nbytes = raw.shape
    blocks = raw.reshape(rows, -1, 210)
    e = np.arange(256)
    h, k, l = e // 128, e % 128 // 32, e % 32
    lo = (blocks[:, :, 64 * h + 32 * (k % 2) + l] >> (4 * (k // 2))) & 15
    hi = (blocks[:, :, 128 + 32 * h + l] >> (2 * k)) & 3
    codes = (lo | (hi << 4)).astype(np.int64) - 32                              # [rows][S][256]
    scales = blocks[:, :, 192:208].view(np.int8).astype(np.int64)                # [rows][S][16]
    d = blocks[:, :, 208:210].copy().view(np.float16).astype(np.float32)[..., 0]  # [rows][S]
    q, dk = quant.quantize_activations(x, 256)
    xq = q.numpy().astype(np.int64).reshape(x.shape[0], -1, 256)                 # [T][S][256]
    dk = dk.numpy()
    weighted = codes * np.repeat(scales, 16, axis=-1)
    acc = np.zeros((x.shape[0], rows), dtype=np.float32)
    for s in range(blocks.shape[1]):
        isum = xq[:, s] @ weighted[:, s].T                                          # exact, |.| < 2^31
        scale = d[None, :, s] * dk[:, s, None]                                      # float32 d * dk
        acc = (isum.astype(np.float32).astype(np.float64) * scale.astype(np.float64) + acc).astype(np.float32)
    return torch.from_numpy(acc)


def test_q6_k_rows_are_the_super_block_arithmetic_bit_for_bit():
    """q6_k's dots (1-4 rows a pass), its GEMM (8+ rows) and the scalar build give exactly the spec's
    integers and one float fma per super-block (a sub-block's scale applied in float, or the offset
    32 off by one, would change bits); each row alone equals it among 7 .. 65 rows, either side
    of the GEMM's crossover."""
    rows, cols = 24, 768
    w, raw = weight("q6_k", rows=rows, cols=cols, seed=4)
    r = r8_of(w)
    x = torch.randn(65, cols, generator=torch.Generator().manual_seed(13)) * 2
    x[3, 256:512] = 0                              # a super-block of zeros (dk = 0)
    expected = _q6_k_super_block_arithmetic(raw, x)
    with quant.using_variant("scalar") as lib:
        assert torch.equal(quant._linear_small(x, [r], None, lib, torch.float32), expected)
    for variant in VECTOR:
        with quant.using_variant(variant) as lib:
            alone = torch.cat([quant._linear_small(x[t:t + 1], [r], None, lib, torch.float32) for t in range(65)])
            assert torch.equal(alone, expected), variant
            for first in (quant.gemm_r8_min_rows(), 8, 1 << 30):
                previous = quant.set_gemm_r8_min_rows(first)
                try:
                    for T in (2, 3, 4, 7, 8, 9, 33, 64, 65):
                        y = quant._linear_small(x[:T], [r], None, lib, torch.float32)
                        assert torch.equal(y, expected[:T]), (variant, first, T, (y - expected[:T]).abs().max())
                finally:
                    quant.set_gemm_r8_min_rows(previous)


@pytest.mark.parametrize("code,sign", [(-128, 1.0), (-128, -1.0), (127, 1.0), (127, -1.0)])
def test_q8_0_gemm_at_the_16_bit_limits(code, sign):
    """Every q8_0 code at one end (-128: its magnitude 128 as an unsigned byte, or 127) against
    activations all at +-127: the GEMM's pairs of products (|w| times x with w's sign) reach
    +-32512 in 16 bits and must still equal the dots (the scalar build's arithmetic)."""
    rows, cols = 16, 512
    blocks = torch.full((rows, cols // 32, 34), code & 0xFF, dtype=torch.uint8)
    blocks[..., 0:2] = torch.tensor([0x00, 0x3C], dtype=torch.uint8)     # d = 1.0
    w = r8_of(quant.from_gguf_blocks("q8_0", blocks.reshape(rows, -1), (rows, cols)))
    x = torch.full((16, cols), sign)
    with quant.using_variant("scalar") as lib:
        ref = quant._linear_small(x, [w], None, lib, torch.float32)
    assert torch.allclose(ref, torch.full_like(ref, code * sign * cols), rtol=1e-5)
    for variant in VECTOR:
        with quant.using_variant(variant) as lib:
            assert torch.equal(quant._linear_small(x, [w], None, lib, torch.float32), ref), variant
