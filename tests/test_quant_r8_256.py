"""The r8 layouts on 256-bit registers (q4_0r8, q4_1r8, q5_0r8, q8_0r8, mxfp4r8 and the super-block q4_kr8,
q5_kr8, q6_kr8: 8 rows interleaved per block, csrc/quant/dot_r8_256.h, dot_k_r8_256.h, dot_mxfp4_r8_256.h): their bytes, and every variant's kernels against the scalar build's,
which spells the same arithmetic out in plain C++ (the avx2, avxvnni and vnni256 ones equal it bit for bit;
the avxvnni test runs where the CPU has AVX-VNNI, vnni256's, the same source with vpdpbusd's EVEX form, where
it has AVX-512 VNNI), on rows and columns that are not multiples of
the threads' share, the 4-row passes or 8 blocks; and a row's result alone equal to it in a batch."""
import numpy as np
import pytest
import torch

from pagedserve.kernels import cpu, quant, threads
from pagedserve.quant_format import _k_scales
from tests.test_quant_kernels import _check_small, weight

TYPES = ["q4_0", "q4_1", "q8_0", "q5_0", "mxfp4"]
K_TYPES = ["q4_k", "q5_k", "q6_k"]
VECTOR = [v for v in ("avx2", "avxvnni", "vnni256") if v in quant.supported_variants()]


def act_block(qtype: str) -> int:
    """The activations' block the r8 kernels of file type qtype multiply (quant.SUPER_ACT)."""
    return 256 if quant.R8_OF.get(qtype) in quant.SUPER_ACT else 32


def r8_of(w: quant.QuantizedWeight) -> quant.QuantizedWeight:
    """w in its r8 layout whatever the variant (repack makes it only on avx2 / avxvnni)."""
    r8 = quant.R8_OF[w.qtype]
    return quant.QuantizedWeight(r8, w.shape, quant.r8_order(r8, w.data, w.shape[0], w.shape[1] // quant.BLOCK[w.qtype],
                                                              True))


@pytest.mark.parametrize("flags, chosen", [
    ({"avx2", "fma", "f16c"}, "avx2"),
    ({"avx2", "fma", "f16c", "avx_vnni"}, "avxvnni"),
    ({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"}, "vnni256"),            # Zen 4
    ({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni", "amx_int8"}, "avx512vnni"),
])
def test_default_variant_by_flags(monkeypatch, flags, chosen):
    """The default quant variant: avx512vnni only where AMX-INT8 is (its AMX paths); an AVX-512 VNNI CPU
    without it takes the r8 layouts' 256-bit kernels (vnni256), as AVX2 and AVX-VNNI CPUs do."""
    monkeypatch.delenv(quant.ENV_VARIANT, raising=False)
    monkeypatch.setattr(cpu, "cpu_flags", lambda: frozenset(flags))
    lib = cpu.KernelLibrary(quant.SOURCE, quant.KERNELS.variants, quant.ENV_VARIANT, {}, "v", "quant kernel", None, "")
    assert lib.choose() == chosen


@pytest.mark.parametrize("qtype", ["q4_0", "q4_1", "q8_0"])
def test_layout_round_trips_and_places_each_row(qtype):
    w, _ = weight(qtype, rows=24, cols=96)
    r = r8_of(w)
    B = quant.BLOCK_BYTES[qtype]
    assert tuple(r.data.shape) == (3, 3 * 8 * B) and r.nbytes == w.nbytes
    assert torch.equal(quant.file_layout(r).data, w.data)
    # unit (group 1, block 2): row 8 + l's d at 2 l (q4_1: m at 16 + 2 l), its code bytes
    # qs[8 k + i] at (after the scales) 64 k + 8 l + i
    unit, blocks = r.data[1, 2 * 8 * B:3 * 8 * B], w.data[8:16, 2 * B:3 * B]
    head = 4 if qtype == "q4_1" else 2
    assert torch.equal(unit[:16].view(8, 2), blocks[:, :2])
    if qtype == "q4_1":
        assert torch.equal(unit[16:32].view(8, 2), blocks[:, 2:4])
    vectors = (B - head) // 8
    assert torch.equal(unit[8 * head:].view(vectors, 8, 8), blocks[:, head:].reshape(8, vectors, 8).transpose(0, 1))
    # an embedding lookup (a tied LM head's table) reads its rows from the groups
    ids = torch.tensor([0, 9, 23, 9, 15])
    assert torch.equal(quant.embedding(r, ids.view(1, 5)), quant.embedding(w, ids.view(1, 5)))


@pytest.mark.parametrize("qtype", K_TYPES + ["q5_0", "mxfp4"])
def test_k_layouts_place_each_field_in_pieces(qtype):
    """A super-block unit (q5_0: a block's, d then qh in 4-byte pieces then qs; mxfp4: the 8 E8M0
    bytes, then qs): each field of the block, in order, piece k of row l at 8 start + piece (8 k + l)."""
    w, _ = weight(qtype, rows=16, cols=512 if qtype in K_TYPES else 64)
    r = r8_of(w)
    B = quant.BLOCK_BYTES[qtype]
    assert tuple(r.data.shape) == (2, 2 * 8 * B) and r.nbytes == w.nbytes
    assert torch.equal(quant.file_layout(r).data, w.data)
    unit, blocks = r.data[1, 8 * B:2 * 8 * B], w.data[8:16, B:2 * B]         # group 1, super-block 1
    for start, size, piece, *at in quant.R8_FIELDS[qtype]:
        place = (at or [start])[0]
        got = unit[8 * place:8 * (place + size)].view(size // piece, 8, piece)
        assert torch.equal(got, blocks[:, start:start + size].reshape(8, size // piece, piece).transpose(0, 1))
    ids = torch.tensor([3, 8, 15, 0])
    assert torch.equal(quant.embedding(r, ids.view(1, 4)), quant.embedding(w, ids.view(1, 4)))


@pytest.mark.parametrize("qtype", TYPES + K_TYPES)
def test_a_decode_steps_lookup_of_an_r8_table(qtype):
    """A decode step's few ids (checked as a list, at most 64) and many (checked by tensor reductions):
    the kernel reads each row's blocks from its group's units and gives the file layout's rows; ids out
    of range still raise."""
    w, _ = weight(qtype, rows=24, cols=quant.BLOCK[qtype] * 3)
    r = r8_of(w)
    for ids in ([0], [7], [8], [23], [9, 9], [23, 0, 14]):
        got = quant.embedding(r, torch.tensor(ids).view(1, -1))
        assert got.shape == (1, len(ids), w.shape[1])
        assert torch.equal(got, quant.dequantize_torch(w)[ids].view(1, len(ids), -1))
    many = torch.arange(70) % 24                      # past 64 ids: the general (tensor) path
    assert torch.equal(quant.embedding(r, many), quant.embedding(w, many))
    assert torch.equal(quant.embedding(r, torch.tensor([5]), torch.bfloat16), quant.embedding(w, torch.tensor([5]),
                                                                                              torch.bfloat16))
    none = torch.empty(0, dtype=torch.int64)          # no ids: an empty lookup, as the general path's
    assert quant.embedding(r, none).shape == quant.embedding(w, none).shape == (0, w.shape[1])
    for bad in ([24], [-1]):
        with pytest.raises(IndexError):
            quant.embedding(r, torch.tensor(bad))


@pytest.mark.skipif(not VECTOR, reason="no avx2 / avxvnni here")
@pytest.mark.parametrize("qtype", TYPES + K_TYPES)
def test_repack_makes_them_on_256_bit_variants(qtype):
    w, _ = weight(qtype, rows=16, cols=quant.BLOCK[qtype] * 2)
    with quant.using_variant(VECTOR[0]):
        r = quant.repack(w)
        assert r.qtype == quant.R8_OF[qtype] and torch.equal(r.data, r8_of(w).data)
        copy = w.data.clone()
        in_place = quant.repack(quant.QuantizedWeight(qtype, w.shape, copy), in_place=True)
        assert in_place.data.data_ptr() == copy.data_ptr() and torch.equal(in_place.data, r.data)
        assert quant.repack(weight(qtype, rows=12, cols=w.shape[1])[0]).qtype == qtype       # rows not a multiple of 8
    with quant.using_variant("scalar"):
        assert quant.repack(w).qtype in (qtype, "q4_0x8")


@pytest.mark.parametrize("qtype", TYPES + K_TYPES)
@pytest.mark.parametrize("rows,blocks", [(8, 1), (24, 3), (40, 49)])
def test_kernels_equal_the_scalar_arithmetic_and_rows_alone(qtype, rows, blocks):
    cols = quant.BLOCK[qtype] * (blocks if quant.BLOCK[qtype] == 32 else (blocks + 7) // 8)
    w, _ = weight(qtype, rows=rows, cols=cols)
    r = r8_of(w)
    bias = torch.randn(rows, generator=torch.Generator().manual_seed(2))
    xs = {T: torch.randn(T, cols, generator=torch.Generator().manual_seed(T)) for T in (1, 2, 3, 5, 9, 33)}
    with quant.using_variant("scalar") as lib:
        ref = {T: quant._linear_small(x, [r], bias, lib, torch.float32) for T, x in xs.items()}
    for T, x in xs.items():
        _check_small(ref[T], x, w, bias, act_block(qtype))
        for t in range(T):      # batch invariance: a row's arithmetic does not depend on the others
            assert torch.equal(ref[1 if T == 1 else T][t], ref[T][t])
    for variant in VECTOR:
        with quant.using_variant(variant) as lib:
            for T, x in xs.items():
                y = quant._linear_small(x, [r], bias, lib, torch.float32)
                assert torch.equal(y, ref[T]), (variant, T, (y - ref[T]).abs().max())
                alone = torch.cat([quant._linear_small(x[t:t + 1], [r], bias, lib, torch.float32) for t in range(T)])
                assert torch.equal(alone, y), (variant, T)
                y16 = quant._linear_small(x.bfloat16(), [r], bias, lib, torch.bfloat16)
                assert torch.equal(y16, quant._linear_small(x.bfloat16(), [r], bias, lib, torch.float32).bfloat16())


@pytest.mark.parametrize("qtype", TYPES + K_TYPES)
def test_other_paths_read_them_as_the_file_layout(qtype):
    """The tiles (T past the integer path), several parts, dequantize, slices: the file layout's values."""
    cols = 576 if quant.BLOCK[qtype] == 32 else 768
    w, _ = weight(qtype, rows=64, cols=cols)
    r = r8_of(w)
    other = quant.quantize(torch.randn(16, cols, generator=torch.Generator().manual_seed(1)), "q8_0")
    assert torch.equal(quant.dequantize(r), quant.dequantize(w))
    assert torch.equal(quant.slice_rows(r, 8, 24).data, quant.slice_rows(w, 8, 24).data)
    assert torch.equal(quant.concat_rows([r, r]).data, quant.concat_rows([w, w]).data)
    for variant in quant.supported_variants():
        with quant.using_variant(variant):
            for T in (3, 40):
                x = torch.randn(T, cols, generator=torch.Generator().manual_seed(T))
                for decode in (False, True):
                    assert torch.equal(quant.linear(x, [r, other], None, decode),
                                       quant.linear(x, [w, other], None, decode)), (variant, T)
                if T > quant.batch_rows(True, False, r8=True):
                    assert torch.equal(quant.linear(x, r, None, True), quant.linear(x, w, None, True)), variant


@pytest.mark.parametrize("rows", [(16, 8, 8), (72, 40, 136)])
@pytest.mark.parametrize("T", [1, 4, 16])
def test_parts_of_several_r8_types_in_one_product(T, rows):
    """A Q4_K_M file's fused q/k/v (q4_k, q4_k, q6_k parts), all r8: each part's groups by the integer
    dots, equal to the same parts one at a time and to the file layout's product; with 1-3 threads
    sharing the groups in items of 8 (the second shape: items that straddle parts, more than one a thread)."""
    cols = 512
    ws = [weight("q4_k", rows=rows[0], cols=cols, seed=1)[0], weight("q4_k", rows=rows[1], cols=cols, seed=2)[0],
          weight("q6_k", rows=rows[2], cols=cols, seed=3)[0]]
    rs = [r8_of(w) for w in ws]
    x = torch.randn(T, cols, generator=torch.Generator().manual_seed(T))
    before = torch.get_num_threads()
    try:
        for variant in ["scalar"] + VECTOR:
            with quant.using_variant(variant) as lib:
                each = torch.cat([quant._linear_small(x, [r], None, lib, torch.float32) for r in rs], dim=1)
                for w, part in zip(ws, each.split(list(rows), dim=1)):
                    _check_small(part, x, w, act_block=act_block(w.qtype))
                for n in (1, 2, 3):
                    threads.set_thread_count(n)
                    y = quant._linear_small(x, rs, None, lib, torch.float32)
                    assert torch.equal(y, each), (variant, n)
    finally:
        threads.set_thread_count(before)


def test_mxfp4r8_every_scale_byte():
    """mxfp4r8's scales built from their exponent bits: every E8M0 byte (the subnormal 2^-128 and
    2^-127 included, the overflowing ones) gives the scalar build's values bit for bit, 255 NaN."""
    rng = np.random.default_rng(3)
    blocks = rng.integers(0, 256, size=(24, 16, 17), dtype=np.uint8)
    blocks[:16, :, 0] = np.arange(256, dtype=np.uint8).reshape(16, 16)         # row 15's last: 255
    blocks[16:, :, 0] = rng.integers(110, 135, size=(8, 16), dtype=np.uint8)
    w = quant.from_gguf_blocks("mxfp4", torch.from_numpy(blocks.reshape(24, 16 * 17)), (24, 16 * 32))
    r = r8_of(w)
    x = torch.randn(3, 16 * 32, generator=torch.Generator().manual_seed(0))
    with quant.using_variant("scalar") as lib:
        ref = quant._linear_small(x, [r], None, lib, torch.float32)
    assert torch.isnan(ref[:, 15]).all() and (ref[:, 0] != 0).all()        # (row 0: scales 2^-127 .. 2^-112)
    _check_small(ref[:, 16:], x, quant.slice_rows(w, 16, 24))
    for variant in VECTOR:
        with quant.using_variant(variant) as lib:
            y = quant._linear_small(x, [r], None, lib, torch.float32)
            torch.testing.assert_close(y, ref, rtol=0, atol=0, equal_nan=True, msg=variant)


@pytest.mark.parametrize("qtype", TYPES + K_TYPES)
def test_repack_in_cpp_equals_the_torch_layout(qtype):
    """The loader's repack (quant_repack_r8, in place, threads over groups) writes r8_order's bytes
    in every variant, in place and into a copy (the source then untouched); any bytes (a shuffle)."""
    rows, nb = 136, 33           # (rows x blocks past 4096: the groups split over threads)
    B = quant.BLOCK_BYTES[qtype]
    raw = torch.randint(0, 256, (rows, nb * B), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    w = quant.QuantizedWeight(qtype, (rows, nb * quant.BLOCK[qtype]), raw.clone())
    expected = r8_of(w).data
    for variant in ["scalar", *VECTOR]:
        with quant.using_variant(variant) as lib:
            data = raw.clone()
            assert lib.quant_repack_r8(quant._QTYPE_ID[quant.R8_OF[qtype]], data.data_ptr(), rows, nb) == 0
            assert torch.equal(data.view(rows // 8, -1), expected), variant
            assert lib.quant_repack_r8(quant._QTYPE_ID[qtype], data.data_ptr(), rows, nb) == 1   # not an r8 type
            assert lib.quant_repack_r8(quant._QTYPE_ID[quant.R8_OF[qtype]], data.data_ptr(), 12, nb) == 1
    for variant in VECTOR:          # repack() itself (it makes r8 layouts on these variants only)
        w = quant.QuantizedWeight(qtype, w.shape, raw.clone())       # (the last variant's repack rewrote it)
        with quant.using_variant(variant):
            copy = quant.repack(w)
            assert copy.qtype == quant.R8_OF[qtype] and torch.equal(copy.data, expected) and torch.equal(w.data, raw)
            assert torch.equal(quant.repack(w, in_place=True).data, expected) and torch.equal(w.data.view(-1),
                                                                                             expected.view(-1))


def _k_super_model(w: quant.QuantizedWeight, x: torch.Tensor, float_sub_block: int | None = None) -> torch.Tensor:
    """q4_k / q5_k r8's arithmetic (dot_k_r8_256.h) spelled out in numpy: per row and super-block the
    integer sums isum = sum_j sc_j dot_j, msum = sum_j m_j bs_j, then acc = fma(float(isum), d * dx, acc),
    mins = fma(float(msum), dmin * dx, mins), y = acc - mins (float32; fma through float64, where a
    product of two float32 is exact). float_sub_block: that sub-block's scale applied in float instead
    (its own fma of float(dot_j) by (d * sc_j) * dx), the arithmetic the per-32 kernels had."""
    f32 = np.float32
    fma = lambda a, b, c: f32(float(a) * float(b) + float(c))       # noqa: E731
    q, dk = quant.quantize_activations(x, 256)
    q, dk = q.numpy().astype(np.int64), dk.numpy()
    rows, cols = w.shape
    blocks = w.data.view(rows, cols // 256, -1).numpy()
    out = np.zeros((x.shape[0], rows), dtype=np.float32)
    for r in range(rows):
        for t in range(x.shape[0]):
            acc = mins = f32(0)
            for s in range(cols // 256):
                b = blocks[r, s]
                d, dmin = (f32(np.frombuffer(b[i:i + 2].tobytes(), dtype=np.float16)[0]) for i in (0, 2))
                sc, mn = (v.to(torch.int64).numpy()[0] for v in _k_scales(torch.from_numpy(b[4:16].copy()).view(1, 12)))
                qs = b[16:144] if w.qtype == "q4_k" else b[48:176]
                xs, dx = q[t, 256 * s:256 * s + 256], f32(dk[t, s])
                isum = msum = 0
                for j in range(8):
                    c = (qs[32 * (j // 2):32 * (j // 2) + 32].astype(np.int64) >> (4 * (j % 2))) & 15
                    if w.qtype == "q5_k":
                        c |= ((b[16:48].astype(np.int64) >> j) & 1) << 4
                    dot = int((c * xs[32 * j:32 * j + 32]).sum())
                    msum += int(mn[j]) * int(xs[32 * j:32 * j + 32].sum())
                    if j == float_sub_block:
                        acc = fma(f32(dot), f32(f32(d * f32(sc[j])) * dx), acc)
                    else:
                        isum += int(sc[j]) * dot
                acc = fma(f32(isum), f32(d * dx), acc)
                mins = fma(f32(msum), f32(dmin * dx), mins)
            out[t, r] = f32(acc - mins)
    return torch.from_numpy(out)


@pytest.mark.parametrize("qtype", ["q4_k", "q5_k"])
def test_k_super_block_arithmetic_is_the_definition(qtype):
    """The q4_k / q5_k r8 kernels (scalar reference, AVX2's dots and GEMM) equal _k_super_model bit for
    bit; the model with one sub-block's scale applied in float does not (the check can fail)."""
    w, _ = weight(qtype, rows=8, cols=512)
    r = r8_of(w)
    x = torch.randn(9, 512, generator=torch.Generator().manual_seed(11)) * 2
    model = _k_super_model(w, x)
    assert not torch.equal(_k_super_model(w, x, float_sub_block=3), model)
    for variant in ["scalar"] + VECTOR:
        with quant.using_variant(variant) as lib:
            for T in (1, 3, 9):          # the dots (1-4 rows a pass), the GEMM from 8 rows
                assert torch.equal(quant._linear_small(x[:T], [r], None, lib, torch.float32), model[:T]), (variant, T)
