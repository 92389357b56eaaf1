"""kernels/quant.py: GGUF block formats decoded exactly as gguf.quants does, and linear layers
over them, for every kernel variant this CPU supports: the small-batch integer path against
the float64 value of its own arithmetic (q8 activations times the dequantized weight), both
paths against the float product."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGML_QUANT_SIZES
from gguf import quants as gq

from pagedserve.kernels import cpu, quant

GGUF_TYPE = {q: getattr(GGMLQuantizationType, q.upper()) for q in quant.QTYPES}
VARIANTS = ["torch"] + quant.supported_variants()
ROWS = 37


def cols_for(qtype: str) -> int:
    return 288 if quant.BLOCK[qtype] == 32 else 768


def random_blocks(qtype: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """uint8 [rows, row_bytes] of valid blocks: gguf's quantizer where it has one, else random
    quants with small random fp16 scales (K-quants)."""
    rng = np.random.default_rng(seed)
    if qtype in ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "mxfp4"):
        x = rng.standard_normal((rows, cols)).astype(np.float32) * 0.05 + rng.standard_normal((rows, 1)) * 0.01
        return gq.quantize(x.astype(np.float32), GGUF_TYPE[qtype])
    nb, bb = cols // 256, quant.BLOCK_BYTES[qtype]
    blocks = rng.integers(0, 256, size=(rows, nb, bb), dtype=np.uint8)

    def f16():
        return (rng.uniform(0.0005, 0.004, size=(rows, nb, 1)).astype(np.float16)).view(np.uint8)
    if qtype in ("q4_k", "q5_k"):
        blocks[..., 0:2], blocks[..., 2:4] = f16(), f16()
    else:
        blocks[..., 208:210] = f16()
    return blocks.reshape(rows, nb * bb)


def weight(qtype: str, rows: int = ROWS, cols: int | None = None,
           seed: int = 0) -> tuple[quant.QuantizedWeight, np.ndarray]:
    cols = cols or cols_for(qtype)
    raw = random_blocks(qtype, rows, cols, seed)
    return quant.from_gguf_blocks(qtype, torch.from_numpy(raw), (rows, cols)), raw


@pytest.fixture(params=VARIANTS)
def variant(request, monkeypatch):
    if request.param == "torch":
        monkeypatch.setattr(quant, "load", lambda: None)        # as where no compiler builds a variant
        monkeypatch.setattr(quant.KERNELS, "lib", None)
        monkeypatch.setattr(quant.KERNELS, "active", "torch")
        yield "torch"
    else:
        with quant.using_variant(request.param) as lib:
            assert lib is not None, f"variant {request.param} did not build"
            assert lib.quant_kernel_variant().decode() == request.param
            yield request.param


def test_block_sizes_match_gguf():
    for q in quant.QTYPES:
        assert (quant.BLOCK[q], quant.BLOCK_BYTES[q]) == GGML_QUANT_SIZES[GGUF_TYPE[q]]


@pytest.mark.parametrize("qtype", quant.QTYPES)
def test_dequantize_matches_gguf(variant, qtype):
    w, raw = weight(qtype)
    expected = torch.from_numpy(gq.dequantize(raw, GGUF_TYPE[qtype]))
    assert torch.equal(quant.dequantize(w), expected)
    assert quant.dequantize(w, torch.bfloat16).dtype == torch.bfloat16


def _check_small(y: torch.Tensor, x: torch.Tensor, w: quant.QuantizedWeight, bias=None, act_block: int | None = None):
    """y against the float64 value of the kernel's own arithmetic: equal up to float32
    summation order; and close to the float product. act_block: the activations' block (256 for
    the super-block r8 layouts, quant.SUPER_ACT: the default where w is one; else 32)."""
    act_block = act_block or quant.activation_block(w.qtype)
    ref = quant.reference_linear(x, w, act_block)
    x8 = quant.q8_activations(x, act_block)
    scale = x8.abs() @ quant.dequantize_torch(w).double().abs().T
    if bias is not None:
        ref = ref + bias.double()
    err = (y.double() - ref).abs()
    assert (err <= 1e-5 * scale + 1e-7).all(), float((err / (scale + 1e-30)).max())
    exact = x.double() @ quant.dequantize_torch(w).double().T + (0 if bias is None else bias.double())
    # one scale per 256 rounds to a step set by the maximum of 8x as many elements (llama.cpp's q8_K
    # activations for its K-quant dots do too): on these weights, whose mean cancels most of the
    # product, 1.4-2.5x the blocks of 32's error (measured at 1, 4 and 16 rows)
    assert float((y.double() - exact).norm() / exact.norm()) < (2e-2 if act_block == 32 else 4e-2)


@pytest.mark.parametrize("qtype", quant.QTYPES)
@pytest.mark.parametrize("tokens", [1, 3, 9, 16])
@pytest.mark.parametrize("width", ["narrow", "wide", "long"])
def test_linear_small_batches(variant, qtype, tokens, width):
    """Widths of 3, 9 or 37 blocks (32-element types: 37 = two groups of 16 and a tail of 5), 1,
    3 or 5 super-blocks: every unrolled loop and its tail; T across the passes of 4 or 8
    activation rows."""
    blocks = {"narrow": (3, 1), "wide": (9, 3), "long": (37, 5)}[width][quant.BLOCK[qtype] != 32]
    cols = quant.BLOCK[qtype] * blocks
    w, _ = weight(qtype, cols=cols)
    x = torch.randn(tokens, w.shape[1], generator=torch.Generator().manual_seed(tokens))
    y = quant.linear(x, w)
    assert y.shape == (tokens, ROWS) and y.dtype == torch.float32
    if variant == "torch":
        torch.testing.assert_close(y, x @ quant.dequantize_torch(w).T, rtol=1e-4, atol=1e-5)
    else:
        _check_small(y, x, w)


@pytest.mark.parametrize("qtype", quant.QTYPES)
@pytest.mark.parametrize("extra", [1, 54])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_large_batches(variant, qtype, extra, dtype, monkeypatch):
    """Dequantized tiles through cpu.py's packed GEMM (extra rows above the integer path's):
    exactly that GEMM over the whole dequantized (bf16-rounded) weight, packed by cpu.pack_weight."""
    monkeypatch.setattr(quant, "tile_rows", lambda cols: 32)          # two tiles, the last partial
    tokens = quant.batch_rows(False, dtype == torch.bfloat16) + extra
    w, _ = weight(qtype)
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, w.shape[1], generator=g).to(dtype)
    bias = torch.randn(ROWS, generator=g)
    y = quant.linear(x, w, bias)
    assert y.dtype == dtype and y.shape == (tokens, ROWS)
    full = quant.dequantize_torch(w)
    if variant != "torch" and cpu.load() is not None:
        assert torch.equal(y, cpu.linear(x, cpu.pack_weight(full.to(dtype)), bias))
    exact = x.float() @ full.T + bias
    if dtype == torch.float32:
        torch.testing.assert_close(y, exact, rtol=1e-4, atol=1e-4)
    else:                                               # bf16 weights and outputs: ~3 significant digits
        assert float((y.float() - exact).norm() / exact.norm()) < 1e-2


@pytest.mark.parametrize("qtype", ["q4_0", "q6_k"])
def test_linear_large_batches_without_packed_gemm(qtype, monkeypatch):
    """Where cpu.py's kernels are missing: float32 scratch tiles and torch.matmul."""
    monkeypatch.setattr(quant, "tile_rows", lambda cols: 16)
    monkeypatch.setattr(cpu, "_kernel", lambda name, x: None)
    w, _ = weight(qtype)
    x = torch.randn(20, w.shape[1]).bfloat16()
    exact = x.float() @ quant.dequantize_torch(w).T
    assert float((quant.linear(x, w).float() - exact).norm() / exact.norm()) < 1e-2


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0", "q4_k", "q6_k"])
def test_bias_and_bf16(variant, qtype):
    w, _ = weight(qtype)
    g = torch.Generator().manual_seed(5)
    bias = torch.randn(ROWS, generator=g)
    for tokens in (2, quant.batch_rows(bf16=True)):    # large batches: test_linear_large_batches
        x = torch.randn(tokens, w.shape[1], generator=g).bfloat16()
        y = quant.linear(x, w, bias)
        assert y.dtype == torch.bfloat16
        y32 = quant.linear(x.float(), w, bias)
        assert torch.equal(y, y32.bfloat16())          # bf16 in: exact in float32; out: rounded once
        wide = torch.cat([x, x[:, :64]], dim=1)[:, :w.shape[1]]   # rows strided (a view of a wider buffer)
        assert wide.stride(0) != wide.shape[1] and torch.equal(quant.linear(wide, w, bias), y)
        if variant != "torch":
            _check_small(y32, x.float(), w, bias)


@pytest.mark.parametrize("qtype", ["q4_1", "q5_k", "q6_k"])
def test_slices(variant, qtype):
    w, _ = weight(qtype, rows=40, cols=2 * cols_for(qtype))
    full = quant.dequantize_torch(w)
    block = quant.BLOCK[qtype]
    rows = quant.slice_rows(w, 8, 29)
    cols = quant.slice_cols(w, block, w.shape[1] - block)
    assert rows.shape == (21, w.shape[1]) and cols.shape == (40, w.shape[1] - 2 * block)
    assert rows.data.data_ptr() == w.data[8].data_ptr()          # views, no copies
    assert torch.equal(quant.dequantize(rows), full[8:29])
    assert torch.equal(quant.dequantize(cols), full[:, block:-block])
    x = torch.randn(3, cols.shape[1])
    y = quant.linear(x, cols)
    if variant == "torch":
        torch.testing.assert_close(y, x @ full[:, block:-block].T, rtol=1e-4, atol=1e-4)
    else:
        _check_small(y, x, cols)
    many = x.repeat(quant.batch_rows() // 3 + 1, 1)                # above the integer path: tiles
    torch.testing.assert_close(quant.linear(many, cols), many @ full[:, block:-block].T,
                               rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError):
        quant.slice_cols(w, 0, block // 2)
    with pytest.raises(ValueError):
        quant.slice_rows(w, 30, 50)
    assert rows.nbytes == 21 * w.row_bytes


@pytest.mark.parametrize("qtype", ["q4_0", "q4_1", "q8_0", "q5_0", "q4_k", "q5_k", "q6_k"])
def test_one_token_row_pairs(variant, qtype):
    """One token: weight rows in pairs (AVX-512: all but q5_0 / q5_1), over rows strided in memory
    (a column slice), an odd row count, groups of 16 blocks and a tail (32-element types); bias
    and bf16 out; each row equal to its own product alone (a pair's rows are independent dots)."""
    if quant.BLOCK[qtype] == 32:
        w, _ = weight(qtype, rows=37, cols=32 * 74)
        cols = quant.slice_cols(w, 96, w.shape[1] - 64)         # 69 blocks: 4 groups and 5 more
    else:
        w, _ = weight(qtype, rows=37, cols=256 * 5)
        cols = quant.slice_cols(w, 256, w.shape[1] - 256)       # 3 super-blocks
    assert cols.data.stride(0) != cols.row_bytes
    x, bias, _ = check_rows_alone(variant, cols, seed=11)
    y16 = quant.linear(x.bfloat16(), cols, bias)
    assert y16.dtype == torch.bfloat16 and torch.equal(y16, quant.linear(x.bfloat16().float(), cols, bias).bfloat16())


def check_rows_alone(variant: str, cols: quant.QuantizedWeight, seed: int):
    """One token through `cols` with a bias: the kernel's own arithmetic (_check_small), and each
    row equal to its own product alone (a pair's rows are independent dots). Returns the token,
    the bias and the generator, for more checks on the same draws."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, cols.shape[1], generator=g)
    bias = torch.randn(cols.shape[0], generator=g)
    y = quant.linear(x, cols, bias)
    if variant != "torch":
        _check_small(y, x, cols, bias)
    singles = torch.cat([quant.linear(x, quant.slice_rows(cols, r, r + 1)) for r in range(cols.shape[0])],
                        dim=1) + bias
    scale = x.abs() @ quant.dequantize_torch(cols).abs().T     # float32 sums in another order: relative to it
    assert ((y - singles).abs() <= 1e-5 * scale + 1e-6).all()
    return x, bias, g


@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_stacked_parts(variant, tokens):
    """Weights of different types stacked by rows (a Q4_K_M-style qkv): one product, equal to
    each part's own."""
    parts = [weight("q4_k", rows=9, seed=1)[0], weight("q6_k", rows=4, seed=2)[0], weight("q8_0", rows=37, cols=768)[0]]
    x = torch.randn(tokens, 768, generator=torch.Generator().manual_seed(tokens))
    bias = torch.randn(50)
    y = quant.linear(x, parts, bias)
    singles = torch.cat([quant.linear(x, p) for p in parts], dim=1) + bias
    torch.testing.assert_close(y, singles, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError):
        quant.linear(x, [parts[0], weight("q4_0")[0]])


def test_decode_batches_take_the_integer_path_further():
    """A decode-only batch (decode=True) of up to DECODE_BATCH_ROWS rows runs the integer dots;
    the same rows as a prefill chunk run the dequantized tiles (the float product). (Without
    the AMX-INT8 dots, which take both kinds alike.)"""
    assert quant.SMALL_BATCH_ROWS < quant.DECODE_BATCH_ROWS
    with quant.using_amx_int8(False):
        _decode_batches_take_the_integer_path_further()


def _decode_batches_take_the_integer_path_further():
    w, _ = weight("q4_0")
    x = torch.randn(quant.DECODE_BATCH_ROWS, w.shape[1], generator=torch.Generator().manual_seed(3))
    _check_small(quant.linear(x, w, decode=True), x, w)
    tiles = quant.linear(x, w)
    torch.testing.assert_close(tiles, x @ quant.dequantize(w).T, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(tiles, quant.linear(x, w, decode=True), rtol=1e-5, atol=1e-5)


def test_pickles_after_use():
    import pickle
    w, _ = weight("q4_0")
    x = torch.randn(2, w.shape[1])
    y = quant.linear(x, w)
    w2 = pickle.loads(pickle.dumps(w))
    assert w2.qtype == w.qtype and w2.shape == w.shape and torch.equal(quant.linear(x, w2), y)


@pytest.mark.parametrize("qtype", ["q8_0", "q4_k", "q6_k"])
def test_embedding(variant, qtype):
    w, _ = weight(qtype)
    ids = torch.tensor([[3, 0, 36], [3, 5, 1]])
    out = quant.embedding(w, ids, torch.bfloat16)
    assert out.shape == (2, 3, w.shape[1]) and out.dtype == torch.bfloat16
    assert torch.equal(out, quant.dequantize_torch(w)[ids].bfloat16())
    with pytest.raises(IndexError):
        quant.embedding(w, torch.tensor([37]))


def test_concat_rows():
    a, _ = weight("q4_k", rows=5, seed=1)
    b, _ = weight("q4_k", rows=7, seed=2)
    both = quant.concat_rows([a, b])
    assert both.shape == (12, a.shape[1])
    assert torch.equal(quant.dequantize(both), torch.cat([quant.dequantize(a), quant.dequantize(b)]))
    with pytest.raises(ValueError):
        quant.concat_rows([a, weight("q6_k", rows=5)[0]])


@pytest.mark.parametrize("qtype", quant.QUANTIZE_TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_matches_gguf(variant, qtype, dtype):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(37, 256, generator=g) * torch.rand(37, 1, generator=g)).to(dtype)
    x[3] = 0                                                     # an all-zero row: d = 0
    x[4, :32] = torch.tensor([1.0, -1.0] * 16)                   # ties in magnitude
    x[5] *= 1e-6                                                 # d a subnormal fp16 (or zero)
    x[6] *= 1e5                                                  # d past fp16's range
    x[7, 64:96] = torch.linspace(-3.5, 4.5, 32)                  # values on rounding boundaries
    w = quant.quantize(x, qtype)
    expected = gq.quantize(x.float().numpy(), GGUF_TYPE[qtype])
    assert np.array_equal(w.data.numpy(), expected)
    assert w.shape == (37, 256) and w.nbytes == expected.nbytes


def test_refusals():
    with pytest.raises(ValueError):
        quant.from_gguf_blocks("q4_0", torch.zeros(2, 18, dtype=torch.uint8), (2, 48))
    with pytest.raises(ValueError):
        quant.QuantizedWeight("q2_k", (1, 256), torch.zeros(1, 84, dtype=torch.uint8))
    with pytest.raises(ValueError):
        quant.quantize(torch.zeros(2, 64), "q4_k")
    flat = quant.from_gguf_blocks("q8_0", torch.zeros(2 * 68, dtype=torch.uint8), (2, 64))
    assert flat.data.shape == (2, 68)


def test_c_entry_points():
    """A compiled caller's view: the C function by address, the weight as a QuantPart."""
    import ctypes
    w, _ = weight("q4_0")
    x = torch.randn(2, w.shape[1])
    address = quant.kernel_address("quant_linear_small")
    assert address
    fn = ctypes.CFUNCTYPE(ctypes.c_int, *quant._SIGNATURES["quant_linear_small"])(address)
    y = torch.empty(2, w.shape[0])
    part = quant.c_part(w)
    assert fn(ctypes.addressof(part), 1, x.data_ptr(), x.stride(0), 0, 2, w.shape[1], None, y.data_ptr(),
              w.shape[0], 0, 0) == 0
    assert torch.equal(y, quant.linear(x, w))


def test_variant_choice(monkeypatch):
    info = quant.describe()
    assert info["quant_kernels"] in quant.supported_variants()
    assert set(info["quant_paths"]) == set(quant.QTYPES)
    monkeypatch.setenv(quant.ENV_VARIANT, "scalar")
    assert quant.choose_variant() == "scalar"
    monkeypatch.setenv(quant.ENV_VARIANT, "nonsense")
    with pytest.raises(ValueError):
        quant.choose_variant()


def test_the_default_models_gguf_tensors():
    """Real blocks: the default model's file (Q4_1 layers, a Q8_0 embedding) as its memory map
    holds them, decoded and multiplied."""
    import warnings

    import gguf
    from pagedserve.models.loader import default_model_path

    reader = gguf.GGUFReader(default_model_path())
    tensors = {t.name: t for t in reader.tensors}
    for name in ("blk.0.attn_q.weight", "blk.3.ffn_down.weight", "token_embd.weight"):
        t = tensors[name]
        qtype = t.tensor_type.name.lower()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")                  # a read-only memory map
            raw = torch.from_numpy(t.data)
        w = quant.from_gguf_blocks(qtype, raw, (int(t.shape[1]), int(t.shape[0])))
        assert w.data.data_ptr() == raw.data_ptr()
        w = quant.slice_rows(w, 0, min(w.shape[0], 512))
        expected = torch.from_numpy(gq.dequantize(t.data[:w.shape[0]], t.tensor_type))
        assert torch.equal(quant.dequantize(w), expected)
        for tokens in (1, 20):
            x = torch.randn(tokens, w.shape[1], generator=torch.Generator().manual_seed(tokens))
            exact = x @ expected.T
            assert float((quant.linear(x, w) - exact).norm() / exact.norm()) < 2e-2


def test_thread_counts_agree():
    """Rows split across threads by bytes: any thread count gives the same bits."""
    parts = [weight("q4_k", rows=21, seed=1)[0], weight("q6_k", rows=30, seed=2)[0]]
    x = torch.randn(3, 768)
    before = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append(quant.linear(x, parts))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(results[0], r) for r in results[1:])


@pytest.fixture
def amx_int8():
    """The avx512vnni variant with its AMX-INT8 dots from 1 row (restored after)."""
    if "avx512vnni" not in quant.supported_variants():
        pytest.skip("this CPU lacks AVX512-VNNI (the AMX-INT8 dots live in that build)")
    with quant.using_variant("avx512vnni"), cpu.using_amx(True), quant.using_amx_int8(True, 1) as on, \
            quant.using_amxw(False):      # bf16 x keeps the integer dots at every row count
        if not on:
            pytest.skip(f"no AMX-INT8 here ({cpu.describe_amx()})")
        yield


@pytest.mark.parametrize("qtype", quant.QTYPES)
@pytest.mark.parametrize("tokens", [1, 5, 16, 17, 27])
@pytest.mark.parametrize("width", ["narrow", "long"])
def test_amx_int8_dots(amx_int8, qtype, tokens, width):
    """AMX-INT8 tiles over 37 weight rows (two groups of 16 and one of 5), widths of 3 or 37
    blocks (1 or 5 super-blocks: pieces in fours and a tail), 1 to 27 activation rows (one or
    two tiles of 16, the last partial): the kernel's own arithmetic up to float32 summation
    order, and not the vpdpbusd path's sums (this path ran)."""
    blocks = {"narrow": (3, 1), "long": (37, 5)}[width][quant.BLOCK[qtype] != 32]
    w, _ = weight(qtype, cols=quant.BLOCK[qtype] * blocks)
    x = torch.randn(tokens, w.shape[1], generator=torch.Generator().manual_seed(tokens))
    assert tokens <= quant.batch_rows(decode=True)     # prefill chunks keep the tiles above 12/16
    y = quant.linear(x, w, decode=True)
    _check_small(y, x, w)
    with quant.using_amx_int8(False):
        vnni = quant._linear_small(x, [w], None, quant.load())
    _check_small(vnni, x, w)
    if width == "long":
        assert not torch.equal(y, vnni)


def test_amx_int8_parts_bias_and_bf16(amx_int8):
    """Parts of three types stacked by rows (q4_k, q6_k: pieces of 16, q4_0) under one call,
    bias, bf16 in and out, rows of x strided: each part the kernel's arithmetic; bf16 out is the
    float32 result rounded once."""
    parts = [weight("q4_k", rows=37, cols=768)[0], weight("q6_k", rows=21, cols=768, seed=1)[0],
             weight("q4_0", rows=18, cols=768, seed=2)[0]]
    g = torch.Generator().manual_seed(23)
    bias = torch.randn(76, generator=g)
    wide = torch.randn(23, 800, generator=g).bfloat16()
    x = wide[:, :768]
    y = quant.linear(x, parts, bias, decode=True)
    y32 = quant.linear(x.float(), parts, bias, decode=True)
    assert y.dtype == torch.bfloat16 and torch.equal(y, y32.bfloat16())
    first = 0
    for w in parts:
        _check_small(y32[:, first:first + w.shape[0]], x.float(), w, bias[first:first + w.shape[0]])
        first += w.shape[0]


@pytest.mark.parametrize("qtype", ["q4_0", "q4_1", "q8_0", "q6_k"])
@pytest.mark.parametrize("tokens", [17, 33])
def test_sampled_rows_past_16(variant, qtype, tokens):
    """The LM head's call for a step's sampled rows (compute_logits(decode=True): float32 logits) and
    a batch-invariant step's products (invariant=True), past the 16 rows prefill chunks take on the
    integer dots, in the layout this variant's repack makes: up to the variant's own limit for such
    rows (batch_rows) the kernel's arithmetic, each row equal to its product alone where the rows
    are r8 on the 256-bit variants (R8_ALL_ROWS), beyond it the float product."""
    w = quant.repack(weight(qtype, rows=40, cols=768 if quant.BLOCK[qtype] == 256 else 288)[0])
    x = torch.randn(tokens, w.shape[1], generator=torch.Generator().manual_seed(tokens))
    r8 = w.qtype in quant.R8
    for kind in ({"decode": True}, {"invariant": True}):
        y = quant.linear(x, w, out_dtype=torch.float32, **kind)
        assert y.shape == (tokens, 40) and y.dtype == torch.float32
        exact = x @ quant.dequantize_torch(quant.file_layout(w)).T
        if variant == "torch" or tokens > quant.batch_rows(bf16=False, r8=r8, **kind):
            torch.testing.assert_close(y, exact, rtol=1e-4, atol=1e-4)      # the tiles
            continue
        _check_small(y, x, quant.file_layout(w), act_block=256 if w.qtype in quant.SUPER_ACT else 32)
        if r8 and variant in quant.R8_VARIANTS:
            alone = torch.cat([quant.linear(x[i:i + 1], w, out_dtype=torch.float32, **kind) for i in range(tokens)])
            assert torch.equal(y, alone)
