"""CUDA graphs for decode steps: the model's decode step (all layers and the LM head)
captured once per batch-size bucket, each decode batch padded to its bucket and replayed.

A graph replays fixed kernels on fixed addresses, so its inputs live in static buffers
that each step copies its batch into. Rows past the batch are padding (`pad_decode_batch`):
token 0 at position 0, slot -1 (the KV write skips it), context length 1 over an all-zero
block table row (attention reads one cached token of block 0: finite, and thrown away
with the row's logits). The attention launch is given max_model_len, a bound on every
sequence's length, so one graph per bucket serves every context length; its grid is
(sequence, KV head, split) with the splits set by the bucket and the GPU's SMs, and each
sequence divides its own context between them (attention/triton_decode.py), so a short
context is spread as wide as a long one. Every graph writes its logits into one static
buffer (the largest bucket's rows), so the graphs' outputs do not add up across buckets
(35 buckets x their rows x a 128k vocabulary in float32 would be 2.2 GB). Steps that are
not all decodes that sample, or are larger than the largest bucket, run eagerly.

A model with KV groups (kv/groups.py: sliding-window layers) has a slot buffer and a
block-table buffer per group, and each group's metadata carries its window: a window
table's leading holes (-1) are never read by the decode kernel, which starts at the window.

Only the Triton attention backend can be captured (the torch reference loops on the
host over the batch); `enforce_eager=True` turns graphs off. The bucketing and padding
are plain host code, tested on the CPU; there `capture=False` runs the same padded
buffers eagerly (tests/test_cuda_graphs.py).
"""
from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field

import torch

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.utils import cdiv

DEFAULT_MAX_CAPTURE = 256
PAD_SLOT = -1          # the KV write skips negative slots
PAD_SEQ_LEN = 1


def capture_sizes(sizes: list[int] | None, max_num_seqs: int) -> list[int]:
    """The batch sizes to capture, ascending, none above max_num_seqs: `sizes`, or by default
    1, 2, 4 and the multiples of 8 up to 256, plus max_num_seqs itself when it is at most 256
    (so that every decode batch the scheduler can form has a bucket)."""
    if sizes is None:
        sizes = [1, 2, 4, *range(8, DEFAULT_MAX_CAPTURE + 1, 8)]
        if max_num_seqs <= DEFAULT_MAX_CAPTURE:
            sizes.append(max_num_seqs)
    return sorted({s for s in sizes if 1 <= s <= max_num_seqs})


def bucket_for(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds num_seqs sequences; None: run eagerly."""
    i = bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


def uses_cuda_graphs(config, device: torch.device, attention) -> bool:
    return device.type == "cuda" and not config.enforce_eager and getattr(attention, "name", None) == "triton"


@dataclass
class DecodeBatch:
    """One decode step on the host: per sequence its token, position, slot, length after
    the step and block table."""
    token_ids: list[int]
    positions: list[int]
    slots: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    # KV groups 1.. (a model with sliding-window layers): each group's slots and block tables
    group_slots: list[list[int]] = field(default_factory=list)
    group_tables: list[list[list[int]]] = field(default_factory=list)


def pad_decode_batch(batch: DecodeBatch, bucket: int) -> dict[str, torch.Tensor]:
    """Host tensors of the batch padded to `bucket` rows (the block tables to the widest
    table's width; the graph's buffers keep whatever stands past it, which no row reads)."""
    n = len(batch.token_ids)
    if not 0 < n <= bucket:
        raise ValueError(f"a decode batch of {n} sequences does not fit a bucket of {bucket}")
    pad = bucket - n

    def padded(tables: list[list[int]]) -> torch.Tensor:
        width = max(len(t) for t in tables)
        return torch.tensor([t + [0] * (width - len(t)) for t in tables] + [[0] * width] * pad, dtype=torch.long)

    def slots(s: list[int]) -> torch.Tensor:
        return torch.tensor(s + [PAD_SLOT] * pad, dtype=torch.long)

    return dict(input_ids=torch.tensor(batch.token_ids + [0] * pad, dtype=torch.long),
                positions=torch.tensor(batch.positions + [0] * pad, dtype=torch.long),
                slot_mapping=slots(batch.slots),
                seq_lens=torch.tensor(batch.seq_lens + [PAD_SEQ_LEN] * pad, dtype=torch.long),
                block_tables=padded(batch.block_tables),
                group_slots=[slots(s) for s in batch.group_slots],
                group_tables=[padded(t) for t in batch.group_tables])


class DecodeGraphs:
    """The captured decode steps of one model over one KV cache tensor."""

    def __init__(self, model, kv_cache: torch.Tensor, sizes: list[int], max_model_len: int, block_size: int,
                 device: torch.device, capture: bool = True, windows: tuple[int | None, ...] = (None,)) -> None:
        if not sizes:
            raise ValueError("no batch sizes to capture")
        self.model, self.kv_cache, self.sizes = model, kv_cache, sizes
        self.max_model_len = max_model_len
        self.max_blocks = cdiv(max_model_len, block_size)
        m = sizes[-1]
        # Static inputs, the largest bucket's; a smaller bucket uses their leading rows.
        self.input_ids = torch.zeros(m, dtype=torch.long, device=device)
        self.positions = torch.zeros(m, dtype=torch.long, device=device)
        self.seq_lens = torch.full((m,), PAD_SEQ_LEN, dtype=torch.long, device=device)
        # Per KV group (one for a model without sliding windows): slots and block tables.
        self.windows = windows
        self.group_slots = [torch.full((m,), PAD_SLOT, dtype=torch.long, device=device) for _ in windows]
        self.group_tables = [torch.zeros(m, self.max_blocks, dtype=torch.long, device=device) for _ in windows]
        self.slot_mapping, self.block_tables = self.group_slots[0], self.group_tables[0]
        self.query_start_loc = torch.arange(m + 1, dtype=torch.long, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: torch.Tensor | None = None        # [largest bucket, vocab]: every graph's output
        self.steps_run = 0                              # decode steps run through the buffers
        if capture:
            self._capture()

    def _meta(self, b: int) -> AttentionMetadata:
        metas = [AttentionMetadata(
            slot_mapping=slots[:b], query_start_loc=self.query_start_loc[:b + 1],
            seq_lens=self.seq_lens[:b], block_tables=tables[:b], num_decodes=b,
            query_start_loc_cpu=list(range(b + 1)), seq_lens_cpu=[self.max_model_len] * b,
            max_seq_len=self.max_model_len,   # the bound the attention launch is sized for
            window=window) for slots, tables, window in zip(self.group_slots, self.group_tables, self.windows)]
        if len(metas) > 1 or self.windows[0] is not None:
            metas[0].groups = metas
        return metas[0]

    def _forward(self, b: int) -> torch.Tensor:
        hidden = self.model.forward(self.input_ids[:b], self.positions[:b], self._meta(b), self.kv_cache)
        return self.model.compute_logits(hidden)

    def _capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        for b in reversed(self.sizes):      # the largest first: the smaller ones reuse its memory
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm up off the capture: compiles the kernels
                warm = self._forward(b)
            torch.cuda.current_stream().wait_stream(stream)
            if self.logits is None:          # outside the graphs' pool, before the first capture
                self.logits = torch.empty(b, warm.shape[1], dtype=warm.dtype, device=warm.device)
            del warm
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[:b].copy_(self._forward(b))    # the graph's own logits are freed in its pool
            self.graphs[b] = graph
        torch.cuda.synchronize()

    def fits(self, num_seqs: int, max_table_len: int) -> bool:
        return bucket_for(num_seqs, self.sizes) is not None and max_table_len <= self.max_blocks

    def run(self, batch: DecodeBatch) -> torch.Tensor:
        """The logits [N, vocab] of a decode batch that `fits` (a view of the graph's output,
        valid until the next run)."""
        n = len(batch.token_ids)
        b = bucket_for(n, self.sizes)
        host = pad_decode_batch(batch, b)
        for name in ("input_ids", "positions", "seq_lens"):
            getattr(self, name)[:b].copy_(host[name], non_blocking=True)
        for slots, tables, s, t in zip(self.group_slots, self.group_tables, [host["slot_mapping"], *host["group_slots"]],
                                       [host["block_tables"], *host["group_tables"]]):
            slots[:b].copy_(s, non_blocking=True)
            tables[:b, :t.shape[1]].copy_(t, non_blocking=True)
        self.steps_run += 1
        if b in self.graphs:
            self.graphs[b].replay()
            return self.logits[:n]
        return self._forward(b)[:n]     # not captured (CPU tests): the same padded inputs, eagerly
