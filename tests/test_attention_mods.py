"""The CPU attention kernels with a layer's sliding window, logit soft-capping (Gemma 2) and
attention sinks (gpt-oss), on every kernel variant this CPU runs: decode rows, prefill chunks
through the tiled kernel (no per-token view is given, so a result proves the tiles ran; the
scalar build has no tiles and takes the per-token view), contexts over a partition, 16-bit and
8-bit caches. The torch backend's reference (`attention_math`, itself checked against
transformers' Gemma 2 and gpt-oss functions in test_hybrid_models.py) is the oracle; blocks
before each window hold NaN, so a kernel that reads one fails."""
from __future__ import annotations

import pytest
import torch

from pagedserve.attention.cpu_backend import CpuAttention
from pagedserve.attention.torch_backend import TorchAttention
from pagedserve.batch import ScheduledTokens
from pagedserve.kernels import cpu
from pagedserve.worker.model_runner import prepare_batch

B = 8
# (context length after the step, new tokens): decodes first (one over a partition), then
# chunks shorter and longer than a query tile, from the start and after cached context.
SPECS = [(37, 1), (700, 1), (9, 1), (45, 7), (120, 40), (26, 26), (70, 3)]


def batch(window: int | None, head_dim: int, num_kv_heads: int, dtype: torch.dtype, kv: str, seed: int = 0):
    """A step over SPECS: the cache (head-major, as the CPU runner's) with every position written,
    the step's metadata, q, and the blocks before each sequence's window (to poison)."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = -(-max(n for n, _ in SPECS) // B)
    num_blocks = 1 + blocks_per_seq * len(SPECS)
    fmt = CpuAttention(kv).kv_format
    width = fmt.row_elements(head_dim)
    cache = torch.zeros(2, num_blocks, num_kv_heads, B, width, dtype=torch.uint8 if fmt.quantized else dtype)
    cache = cache.transpose(2, 3)
    seqs, poison = [], []
    for i, (length, new) in enumerate(SPECS):
        table = list(range(1 + blocks_per_seq * i, 1 + blocks_per_seq * i + -(-length // B)))
        first = 0 if window is None else max(0, length - new - window + 1) // B
        poison += table[:first]
        seqs.append(ScheduledTokens(i, [0] * new, length - new, [-1] * first + table[first:]))
        slots = torch.tensor([table[p // B] * B + p % B for p in range(length)])
        k, v = (torch.randn(length, num_kv_heads, head_dim, generator=g).to(dtype) for _ in range(2))
        TorchAttention(kv).write_kv(cache, k, v, slots)
    _, _, meta = prepare_batch(seqs, B, "cpu", windows=(window,))
    return cache, meta, poison, g


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,num_heads,num_kv_heads", [(64, 8, 2), (128, 4, 4), (32, 6, 1)])
@pytest.mark.parametrize("window,softcap,with_sinks", [(None, 1.5, False), (None, 0.0, True), (20, 1.5, True),
                                                       (20, 0.0, False), (64, 30.0, True)])
def test_kernels_take_window_softcap_and_sinks(kernel_variant, dtype, head_dim, num_heads, num_kv_heads, window,
                                               softcap, with_sinks):
    cache, meta, poison, g = batch(window, head_dim, num_kv_heads, dtype, "auto")
    q = (torch.randn(meta.query_start_loc_cpu[-1], num_heads, head_dim, generator=g) * 2).to(dtype)
    sinks = torch.randn(num_heads, generator=g) * 2 if with_sinks else None
    scale = head_dim ** -0.5
    ref = TorchAttention()._reference(q, None, None, cache, meta, scale, softcap, sinks)
    cache[:, poison] = float("nan")
    tiled = kernel_variant in cpu.TILED_PREFILL_VARIANTS
    rows = cpu.AttentionRows.of(meta.block_tables, meta.seq_lens, meta.query_start_loc, meta.num_decodes,
                                None if tiled else meta.per_token, meta.window)
    out = cpu.paged_attention(q, cache, rows, scale, 0, cpu.ScoreMods.of(softcap, sinks))
    assert out is not None and not out.isnan().any()      # (None: the kernel did not run)
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.float(), ref.float(), **tol)


@pytest.mark.parametrize("kv", ["fp8_e4m3", "int8"])
def test_8bit_caches_take_window_softcap_and_sinks(kernel_variant, kv):
    cache, meta, poison, g = batch(24, 64, 2, torch.float32, kv)
    q = torch.randn(meta.query_start_loc_cpu[-1], 6, 64, generator=g)
    sinks = torch.randn(6, generator=g)
    ref = TorchAttention(kv)._reference(q, None, None, cache, meta, 0.125, 2.0, sinks)
    cache[:, poison] = 255          # NaN codes in either format
    attn = CpuAttention(kv)
    out = cpu.paged_attention(q, cache, attn.kernel_rows(meta), 0.125, attn.kv_format.code, cpu.ScoreMods.of(2.0, sinks))
    assert out is not None and not out.isnan().any()
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_cpu_backend_runs_the_kernels_not_the_reference(monkeypatch):
    """Soft-capping and sinks no longer send a layer to the torch reference; a sink count that is
    not one per query head is refused before the kernel reads past it."""
    cache, meta, _, g = batch(20, 64, 2, torch.float32, "auto")
    q = torch.randn(meta.query_start_loc_cpu[-1], 4, 64, generator=g)
    backend = CpuAttention()
    backend.prepare(meta)
    monkeypatch.setattr(TorchAttention, "_reference", lambda *a, **k: pytest.fail("fell back to the reference"))
    k = v = torch.zeros(0, 2, 64)
    meta.slot_mapping = torch.zeros(0, dtype=torch.int64)
    backend.forward(q, k, v, cache, meta, 0.125, 1.5, torch.randn(4))
    with pytest.raises(ValueError, match="3 logits for 4 query heads"):
        cpu.paged_attention(q, cache, backend.kernel_rows(meta), 0.125, 0, cpu.ScoreMods.of(0.0, torch.randn(3)))
