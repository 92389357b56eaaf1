"""q4_1r8: q4_1 matrices with 8 rows interleaved per block (quant.repack), against the file's layout."""
import pytest
import torch

from pagedserve.kernels import quant
from tests.test_quant_kernels import _check_small, weight

pytestmark = pytest.mark.skipif(quant.variant() != "avx512vnni", reason="q4_1r8 is made where the avx512vnni kernels run")


def test_layout_round_trips_and_places_each_row():
    w, _ = weight("q4_1", rows=24, cols=96)
    r = quant.repack(w)
    assert r.qtype == "q4_1r8" and tuple(r.data.shape) == (3, 3 * 160) and r.nbytes == w.nbytes
    assert torch.equal(quant.file_layout(r).data, w.data)
    # unit (group 1, block 2): row 8 + l's d at 2 l, m at 16 + 2 l, qs[8 k + i] at 32 + 64 k + 8 l + i
    unit, blocks = r.data[1, 2 * 160:3 * 160], w.data[8:16, 2 * 20:3 * 20]
    assert torch.equal(unit[:16].view(8, 2), blocks[:, :2])
    assert torch.equal(unit[16:32].view(8, 2), blocks[:, 2:4])
    assert torch.equal(unit[32:].view(2, 8, 8), blocks[:, 4:].reshape(8, 2, 8).transpose(0, 1))
    copy = w.data.clone()
    in_place = quant.repack(quant.QuantizedWeight("q4_1", w.shape, copy), in_place=True)
    assert in_place.data.data_ptr() == copy.data_ptr() and torch.equal(in_place.data.view(3, -1), r.data)
    # not repacked: rows not a multiple of 8, the switch off
    assert quant.repack(weight("q4_1", rows=12, cols=96)[0]).qtype == "q4_1"


def test_the_rest_reads_it_as_the_file_layout():
    w, _ = weight("q4_1", rows=64, cols=576)
    r = quant.repack(w)
    assert torch.equal(quant.dequantize(r), quant.dequantize(w))
    assert torch.equal(quant.dequantize_torch(r), quant.dequantize_torch(w))
    ids = torch.tensor([0, 9, 63])
    assert torch.equal(quant.embedding(r, ids), quant.embedding(w, ids))
    assert torch.equal(quant.slice_rows(r, 8, 24).data, quant.slice_rows(w, 8, 24).data)
    assert torch.equal(quant.slice_cols(r, 64, 256).data, quant.slice_cols(w, 64, 256).data)
    assert torch.equal(quant.concat_rows([r, r]).data, quant.concat_rows([w, w]).data)


@pytest.mark.parametrize("rows,cols", [(64, 576), (96, 1536), (8, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_products_equal_the_file_layouts(rows, cols, dtype):
    """Every path and variant: its integer dots (any T, several parts) against the kernel's own
    arithmetic; the tiles (AMX-BF16 reading it natively, the others through rows unpacked into
    the file's layout) bit for bit the q4_1 rows'."""
    w, _ = weight("q4_1", rows=rows, cols=cols)
    r = quant.repack(w)
    other = quant.quantize(torch.randn(16, cols, generator=torch.Generator().manual_seed(1)), "q8_0")
    bias = torch.randn(rows, generator=torch.Generator().manual_seed(2))
    for variant in quant.supported_variants():
        with quant.using_variant(variant):
            for T in (1, 2, 5, 9, 32, 33, 100, 400):
                x = torch.randn(T, cols, generator=torch.Generator().manual_seed(T)).to(dtype)
                for decode in (False, True):
                    y = quant.linear(x, r, bias, decode)
                    r8_rows = quant.batch_rows(decode, dtype == torch.bfloat16, r8=True, gemm=True)   # (as linear asks)
                    if T <= r8_rows:       # (bf16 y: its float32 sums rounded)
                        y32 = quant.linear(x, r, bias, decode, torch.float32)
                        _check_small(y32, x.float(), w, bias)
                        assert torch.equal(y, y32.to(dtype))
                    else:
                        assert torch.equal(y, quant.linear(x, w, bias, decode)), (variant, T, decode)
                    # with a part of another type: the same product as the file layout's
                    assert torch.equal(quant.linear(x, [r, other], None, decode),
                                       quant.linear(x, [w, other], None, decode)), (variant, T, decode)
