"""The compiled layer loop's LoRA kernel (cpu_kernels.cpp lora_delta through kernels/cpu.py
lora_delta) against a torch reference: rows of several adapters interleaved with base rows,
ragged ranks and parts an adapter does not target, more rows of one adapter than a block
holds, shapes off the vector widths, float32 and bf16, one thread and the team, on every
kernel variant."""
import pytest
import torch

from pagedserve.kernels import cpu

R = 8                       # rank rows per part and slot (max_lora_rank)


def reference(x, A, BT, sizes, info, blocks, y):
    """y + each row's own slot's delta: u = x @ A_s.T rounded to the dtype, then u @ BT_s in
    float32 over the ranks the slot fills, rounded into y once. Base rows (-1) unchanged."""
    out, K = y.float().clone(), len(sizes) * R
    offsets = [sum(sizes[:j]) for j in range(len(sizes))]
    for t, s in enumerate(blocks.tolist()):
        if s < 0:
            continue
        rank, parts = info[s] & 0xFFFF, info[s] >> 16
        for j, (off, size) in enumerate(zip(offsets, sizes)):
            if rank and (parts >> j) & 1:
                rows = slice(s * K + j * R, s * K + j * R + rank)
                u = (x[t].float() @ A[rows].float().T).to(x.dtype).float()
                out[t, off:off + size] += u @ BT[rows, off:off + size].float()
    return out.to(y.dtype)


def make(dtype, span, hidden, sizes, seed=0):
    g = torch.Generator().manual_seed(seed)
    K = len(sizes) * R
    A = (torch.randn(1, span * K, hidden, generator=g) * hidden ** -0.5).to(dtype)
    BT = (torch.randn(1, span * K, sum(sizes), generator=g) * 0.5).to(dtype)
    return A, BT


@pytest.fixture(autouse=True)
def kernels():
    if cpu.load() is None:
        pytest.skip("no CPU kernels")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,hidden,sizes", [
    (11, 40, [24, 8, 8]),          # qkv-like, below the vector widths: tails everywhere
    (37, 144, [200, 72, 72]),      # several blocks per slot; columns past a 64-wide tile
    (300, 576, [576, 192, 192]),   # a prefill chunk's rows: the team of threads takes it
])
def test_each_row_gets_its_own_adapters_delta(kernel_variant, dtype, rows, hidden, sizes):
    span = 4
    A, BT = make(dtype, span, hidden, sizes)
    # slot 0: rank 8, every part; 1: rank 3, parts 0 and 2; 2: nothing loaded; 3: rank 5, part 1
    info = [8 | 0b111 << 16, 3 | 0b101 << 16, 0, 5 | 0b010 << 16]
    g = torch.Generator().manual_seed(1)
    blocks = torch.randint(-1, span, (rows,), generator=g)
    blocks[:4] = torch.tensor([0, -1, 1, 3])
    x = torch.randn(rows, hidden, generator=g).to(dtype)
    y = torch.randn(rows, sum(sizes), generator=g).to(dtype)
    # Only the filled rank rows may count: junk beyond them must be ignored, as zeros would be.
    table = cpu.LoraTable(1, ("test",), {"qkv": (A, BT, sizes)}, R, [v for s in info for v in (s, 0, 0, 0)])
    got = y.clone()
    assert cpu.lora_delta(table, 0, 0, x, got, blocks)
    want = reference(x, A[0], BT[0], sizes, info, blocks, y)
    base = blocks < 0
    assert torch.equal(got[base], y[base]), "base rows must be untouched"
    tol = dict(rtol=0, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=2e-2)
    torch.testing.assert_close(got.float(), want.float(), **tol)
    # The delta is large against the tolerance: another slot's weights would fail.
    mixed = torch.where(blocks >= 0, (blocks + 1) % span, blocks)
    other = reference(x, A[0], BT[0], sizes, info, mixed, y)
    assert (other.float() - want.float()).abs().max() > 0.3


def test_untargeted_projections_and_slots_cost_nothing():
    A, BT = make(torch.float32, 2, 32, [16])
    table = cpu.LoraTable(1, ("test",), {"o": (A, BT, [16])}, R, [0, 0, 0, 0, 0, 0, 0, 0])
    x, y = torch.randn(5, 32), torch.randn(5, 16)
    got = y.clone()
    assert cpu.lora_delta(table, 0, 1, x, got, torch.tensor([0, 1, 0, 1, -1]))     # no slot fills o
    assert cpu.lora_delta(table, 0, 0, x, got, torch.tensor([0, 1, 0, 1, -1]))     # no qkv delta at all
    assert torch.equal(got, y)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("rows,hidden,sizes", [
    (70, 64, [64, 32, 40]),        # 16-row tiles and a partial one; a part's column tail (40 % 16)
    (150, 576, [576, 192, 192]),   # the default model's qkv: several tile rows per slot
])
def test_amx_tiles_match_the_reference(rows, hidden, sizes, packed, monkeypatch):
    """bf16 with max_lora_rank 16: slots with at least kLoraAmxRows rows take AMX tiles (where
    the CPU has them), the rest the vector path; BT paired at load (lora_pack_bt) or per call.
    Ragged ranks, untargeted parts, base rows, junk past the filled rank rows."""
    monkeypatch.setitem(globals(), "R", 16)     # max_lora_rank 16: AMX's tile shapes
    with cpu.using_amx(True):
        if not cpu.amx_in_use():
            pytest.skip("no AMX on this CPU (or not in this kernel variant)")
        span = 4
        A, BT = make(torch.bfloat16, span, hidden, sizes)
        # slot 0: rank 16, every part; 1: rank 5, parts 0 and 2; 2: nothing; 3: rank 11, part 1
        info = [16 | 0b111 << 16, 5 | 0b101 << 16, 0, 11 | 0b010 << 16]
        g = torch.Generator().manual_seed(2)
        blocks = torch.randint(-1, span, (rows,), generator=g)
        blocks[-3:] = torch.tensor([3, 3, 3])           # at least 3 rows of slot 3 anyway
        blocks[rows // 2:] = torch.where(blocks[rows // 2:] == 3, -1, blocks[rows // 2:])   # slot 3: few rows
        x = torch.randn(rows, hidden, generator=g).to(torch.bfloat16)
        y = torch.randn(rows, sum(sizes), generator=g).to(torch.bfloat16)
        module = (A, BT, sizes, cpu.lora_pack_bt(BT)) if packed else (A, BT, sizes)
        table = cpu.LoraTable(1, ("test",), {"qkv": module}, R, [v for s in info for v in (s, 0, 0, 0)])
        want = reference(x, A[0], BT[0], sizes, info, blocks, y)
        got = y.clone()
        assert cpu.lora_delta(table, 0, 0, x, got, blocks)
        base = blocks < 0
        assert torch.equal(got[base], y[base]), "base rows must be untouched"
        torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=2e-2)
        with cpu.using_amx(False):          # the vector path: the same sums up to float32 order
            vec = y.clone()
            assert cpu.lora_delta(table, 0, 0, x, vec, blocks)
        torch.testing.assert_close(got.float(), vec.float(), rtol=1.6e-2, atol=2e-2)
        mixed = torch.where(blocks >= 0, (blocks + 1) % span, blocks)
        other = reference(x, A[0], BT[0], sizes, info, mixed, y)
        assert (other.float() - want.float()).abs().max() > 0.3
        assert (got.float() - y.float())[blocks == 0].abs().max() > 0.3, "the delta must be there"


@pytest.mark.parametrize("dtype,amx", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)])
@pytest.mark.parametrize("rows,hidden,sizes,info,blocks", [
    # one slot with every row (a single AMX block at bf16): one item per part
    (16, 576, [576, 192, 192], [16 | 0b111 << 16], [0] * 16),
    # one slot, one part, a few rows: one shrink item, the expand's columns shared
    (4, 2048, [2048], [16 | 0b1 << 16], [0, 0, 0, 0]),
    # two slots, ragged ranks and parts, base rows between; column tails off 16 (200, 72), a
    # part boundary (600) off 16 inside a thread's columns
    (7, 1408, [600, 200, 72], [11 | 0b101 << 16, 16 | 0b111 << 16], [0, -1, 1, 0, 1, -1, 0]),
])
def test_few_blocks_split_over_the_team(kernel_variant, monkeypatch, dtype, amx, rows, hidden, sizes, info, blocks):
    """Fewer row blocks than two per thread (one slot holding the rows): the shrink is cut per
    part and the expand in column ranges so the team shares it; the sums stay each row's own
    slot's."""
    monkeypatch.setitem(globals(), "R", 16)
    with cpu.using_amx(amx):
        if amx and not cpu.amx_in_use():
            pytest.skip("no AMX on this CPU (or not in this kernel variant)")
        span = len(info)
        A, BT = make(dtype, span, hidden, sizes, seed=3)
        g = torch.Generator().manual_seed(4)
        blocks = torch.tensor(blocks)
        x = torch.randn(rows, hidden, generator=g).to(dtype)
        y = torch.randn(rows, sum(sizes), generator=g).to(dtype)
        module = (A, BT, sizes, cpu.lora_pack_bt(BT)) if dtype == torch.bfloat16 else (A, BT, sizes)
        table = cpu.LoraTable(1, ("test",), {"qkv" if len(sizes) == 3 else "o": module}, R,
                              [v for s in info for v in ((s, 0, 0, 0) if len(sizes) == 3 else (0, s, 0, 0))])
        got = y.clone()
        assert cpu.lora_delta(table, 0, 0 if len(sizes) == 3 else 1, x, got, blocks)
        want = reference(x, A[0], BT[0], sizes, info, blocks, y)
        base = blocks < 0
        assert torch.equal(got[base], y[base]), "base rows must be untouched"
        tol = dict(rtol=0, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=2e-2)
        torch.testing.assert_close(got.float(), want.float(), **tol)
        assert (got.float() - y.float())[~base].abs().max() > 0.3, "the delta must be there"
        if span > 1:
            mixed = torch.where(blocks >= 0, (blocks + 1) % span, blocks)
            other = reference(x, A[0], BT[0], sizes, info, mixed, y)
            assert (other.float() - want.float()).abs().max() > 0.3
