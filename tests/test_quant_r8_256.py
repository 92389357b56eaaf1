"""The r8 layouts on 256-bit registers (q4_0r8, q4_1r8, q8_0r8: 8 rows interleaved per block,
csrc/quant/dot_r8_256.h): their bytes, and every variant's kernels against the scalar build's,
which spells the same arithmetic out in plain C++ (the avx2 and avxvnni ones equal it bit for bit;
the avxvnni test runs where the CPU has AVX-VNNI), on rows and columns that are not multiples of
the threads' share, the 4-row passes or 8 blocks; and a row's result alone equal to it in a batch."""
import pytest
import torch

from pagedserve.kernels import quant
from tests.test_quant_kernels import _check_small, weight

TYPES = ["q4_0", "q4_1", "q8_0"]
VECTOR = [v for v in ("avx2", "avxvnni") if v in quant.supported_variants()]


def r8_of(w: quant.QuantizedWeight) -> quant.QuantizedWeight:
    """w in its r8 layout whatever the variant (repack makes it only on avx2 / avxvnni)."""
    r8 = quant.R8_OF[w.qtype]
    return quant.QuantizedWeight(r8, w.shape, quant.r8_order(r8, w.data, w.shape[0], w.shape[1] // 32, True))


@pytest.mark.parametrize("qtype", TYPES)
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
    # an embedding lookup (a tied LM head's table) gathers its rows from the groups
    ids = torch.tensor([0, 9, 23, 9, 15])
    assert torch.equal(quant.r8_rows(r, ids), w.data[ids])
    assert torch.equal(quant.embedding(r, ids.view(1, 5)), quant.embedding(w, ids.view(1, 5)))


@pytest.mark.skipif(not VECTOR, reason="no avx2 / avxvnni here")
@pytest.mark.parametrize("qtype", TYPES)
def test_repack_makes_them_on_256_bit_variants(qtype):
    w, _ = weight(qtype, rows=16, cols=64)
    with quant.using_variant(VECTOR[0]):
        r = quant.repack(w)
        assert r.qtype == quant.R8_OF[qtype] and torch.equal(r.data, r8_of(w).data)
        copy = w.data.clone()
        in_place = quant.repack(quant.QuantizedWeight(qtype, w.shape, copy), in_place=True)
        assert in_place.data.data_ptr() == copy.data_ptr() and torch.equal(in_place.data, r.data)
        assert quant.repack(weight(qtype, rows=12, cols=64)[0]).qtype == qtype       # rows not a multiple of 8
    with quant.using_variant("scalar"):
        assert quant.repack(w).qtype in (qtype, "q4_0x8")


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("rows,cols", [(8, 32), (24, 96), (40, 1568)])
def test_kernels_equal_the_scalar_arithmetic_and_rows_alone(qtype, rows, cols):
    w, _ = weight(qtype, rows=rows, cols=cols)
    r = r8_of(w)
    bias = torch.randn(rows, generator=torch.Generator().manual_seed(2))
    xs = {T: torch.randn(T, cols, generator=torch.Generator().manual_seed(T)) for T in (1, 2, 3, 5, 9, 33)}
    with quant.using_variant("scalar") as lib:
        ref = {T: quant._linear_small(x, [r], bias, lib, torch.float32) for T, x in xs.items()}
    for T, x in xs.items():
        _check_small(ref[T], x, w, bias)
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


@pytest.mark.parametrize("qtype", TYPES)
def test_other_paths_read_them_as_the_file_layout(qtype):
    """The tiles (T past the integer path), several parts, dequantize, slices: the file layout's values."""
    w, _ = weight(qtype, rows=64, cols=576)
    r = r8_of(w)
    other = quant.quantize(torch.randn(16, 576, generator=torch.Generator().manual_seed(1)), "q8_0")
    assert torch.equal(quant.dequantize(r), quant.dequantize(w))
    assert torch.equal(quant.slice_rows(r, 8, 24).data, quant.slice_rows(w, 8, 24).data)
    assert torch.equal(quant.concat_rows([r, r]).data, quant.concat_rows([w, w]).data)
    for variant in quant.supported_variants():
        with quant.using_variant(variant):
            for T in (3, 40):
                x = torch.randn(T, 576, generator=torch.Generator().manual_seed(T))
                for decode in (False, True):
                    assert torch.equal(quant.linear(x, [r, other], None, decode),
                                       quant.linear(x, [w, other], None, decode)), (variant, T)
                if T > quant.batch_rows(True, False, r8=True):
                    assert torch.equal(quant.linear(x, r, None, True), quant.linear(x, w, None, True)), variant
