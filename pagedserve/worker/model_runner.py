"""The worker: owns the KV cache tensor, turns a StepBatch into one flat batch, runs the
model and samples.

It knows nothing of scheduling policy or of requests: it receives plain data
(pagedserve/batch.py) naming which tokens of which sequences to compute, which blocks
to move first and how to sample, and it reports the sampled tokens back. The one thing
it keeps between steps is each seeded sequence's random generator, keyed by seq id,
created from the seed the first time the sequence samples and dropped when a batch lists
the sequence as finished. On CUDA, decode steps replay captured graphs
(worker/cuda_graphs.py) and sampling runs on the device.
"""
from __future__ import annotations

from collections.abc import Collection

import torch

from pagedserve.attention.kv_format import KVFormat, kv_format
from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.kv.groups import KVGroups, plan_kv_groups
from pagedserve.models import huge_pages
from pagedserve.batch import PromptTokenLogprob, RunnerOutput, SampleRow, ScheduledTokens, StepBatch, TierReport
from pagedserve.sampling.sampler import Sampler, SamplingRow
from pagedserve.spec_decode.rejection import DraftRow, verify
from pagedserve.worker.cuda_graphs import DecodeBatch, DecodeGraphs


def kv_cache_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                             dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    """The real bytes of one block (every layer's K and V; an 8-bit format's codes and scales)."""
    return block_size * kv_format(kv_cache_dtype).bytes_per_token(num_layers, num_kv_heads, head_dim, dtype)


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, mapping: list[tuple[int, int]]) -> None:
    """Copy whole blocks (all layers, K and V) between the device cache and swap space."""
    if mapping:
        s, d = zip(*mapping)
        dst[:, :, list(d)] = src[:, :, list(s)].to(dst.device)


def prepare_batch(batch: list[ScheduledTokens], block_size: int, device,
                  group_block_ids: dict[int, list[list[int]]] | None = None,
                  windows: tuple[int | None, ...] = (None,)) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """The flat batch of a step's sequences (their tokens, then their drafts): token ids,
    positions and the attention metadata (slots from the block tables). A hybrid model's KV
    groups (`windows`, kv/groups.py) each get their metadata, from their tables
    (`group_block_ids`: groups 1..'s by seq id, StepBatch.group_block_ids), in meta.groups."""
    B = block_size
    ids: list[int] = []
    pos: list[int] = []
    qsl = [0]
    seq_lens = []
    tables: list[list[list[int]]] = [[] for _ in windows]     # per group, per sequence
    for s in batch:
        n = s.num_query_tokens
        ids.extend(s.token_ids)
        ids.extend(s.draft_token_ids)
        pos.extend(range(s.start, s.start + n))
        qsl.append(qsl[-1] + n)
        seq_lens.append(s.start + n)
        for g, table in enumerate([s.block_ids, *(group_block_ids[s.seq_id] if len(windows) > 1 else ())]):
            tables[g].append(table)
    dev = device
    shared = dict(query_start_loc=torch.tensor(qsl, dtype=torch.long, device=dev),
                  seq_lens=torch.tensor(seq_lens, dtype=torch.long, device=dev),
                  num_decodes=sum(1 for s in batch if s.is_decode),
                  num_verify=sum(1 for s in batch if len(s.token_ids) == 1 and s.draft_token_ids),
                  query_start_loc_cpu=qsl, seq_lens_cpu=seq_lens, max_seq_len=max(seq_lens))
    metas = []
    for window, group in zip(windows, tables):
        slots = [table[p // B] * B + p % B for table, s in zip(group, batch) for p in range(s.start, s.start + s.num_query_tokens)]
        width = max(len(t) for t in group)
        metas.append(AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in group], dtype=torch.long, device=dev),
            window=window, **shared))
    meta = metas[0]
    if len(metas) > 1 or windows[0] is not None:
        meta.groups = metas
    return torch.tensor(ids, dtype=torch.long, device=dev), torch.tensor(pos, dtype=torch.long, device=dev), meta


def _rows(hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """hidden's rows `rows`: hidden itself where they are all of its rows in order (a single-stream decode
    step's: a list index makes a tensor of the list and gathers, ~5 us hot, more in a step)."""
    return hidden if rows == list(range(hidden.shape[0])) else hidden[rows]


class ModelRunner:
    def __init__(self, model, num_blocks: int, block_size: int, sampler: Sampler,
                 device: torch.device = torch.device("cpu"), num_host_blocks: int = 0,
                 kv_groups: KVGroups | None = None) -> None:
        a = model.args
        self.model = model
        self.block_size = block_size
        # A hybrid model's KV groups (kv/groups.py): a block holds layers_per_block layers' K and V
        # (those of the group whose table names it); the model reads model.kv_groups.
        self.kv_groups = kv_groups or plan_kv_groups([None] * a.num_layers)
        model.kv_groups = self.kv_groups
        layers = self.kv_groups.layers_per_block
        self.sampler = sampler
        self.device = device   # of the model, the KV cache, the batch tensors and the sampler
        # One tensor for all layers, indexed [layers, K/V, blocks, block_size, kv_heads, head_dim].
        # The CPU backend stores it head-major within a block (a view of [..., kv_heads,
        # block_size, head_dim]): one head's keys of a block are then 2 KB in a row, which the
        # CPU prefetches well; its kernels read strides. The others want it contiguous. An 8-bit
        # KV format (the attention backend's) stores uint8 rows: head_dim codes (+ their scale),
        # attention/kv_format.py; the scales travel with their blocks.
        head_major = model.attention.head_major_cache
        fmt: KVFormat = getattr(model.attention, "kv_format", kv_format("auto"))
        self.kv_cache = self._allocate(a, num_blocks, block_size, model.dtype, device, head_major, fmt, num_layers=layers)
        # Swap space (preemption_mode="swap"): the same layout in host memory (pinned, next to a GPU).
        self.host_cache = self._allocate(a, num_host_blocks, block_size, model.dtype, torch.device("cpu"), head_major,
                                         fmt, pin_memory=torch.device(device).type == "cuda", num_layers=layers)
        self.generators: dict[int, torch.Generator] = {}   # seq_id -> generator of a seeded sequence
        self.decode_graphs: DecodeGraphs | None = None      # set by capture_cuda_graphs
        self.lora = None   # multi-LoRA (lora/weights.py LoRAWeights): set by the worker when enabled
        self.lora_errors: dict[int, str] = {}    # slot -> a load that failed, for the step's RunnerOutput
        self.draft = None  # speculative method draft_model (spec_decode/draft_model.py): set by the worker
        self.tier = None   # the prefix cache's disk tier (worker/kv_tier.py KVTierStore): set by the worker

    def capture_cuda_graphs(self, sizes: list[int], max_model_len: int, capture: bool = True) -> None:
        """Capture the decode step for these batch sizes (capture=False: pad and run the same
        buffers eagerly, which is how the CPU tests check the padding)."""
        self.decode_graphs = DecodeGraphs(self.model, self.kv_cache, sizes, max_model_len, self.block_size,
                                          torch.device(self.device), capture, self.kv_groups.windows)

    @staticmethod
    def _allocate(a, num_blocks: int, block_size: int, dtype: torch.dtype, device, head_major: bool,
                  fmt: KVFormat, pin_memory: bool = False, num_layers: int | None = None) -> torch.Tensor:
        """num_layers: the layer slots of a block (default: all the model's layers)."""
        inner = (a.num_kv_heads, block_size) if head_major else (block_size, a.num_kv_heads)
        shape = (num_layers or a.num_layers, 2, num_blocks, *inner, fmt.row_elements(a.head_dim))
        # On the CPU in huge pages (models/huge_pages.py: a decode step reads blocks scattered over it).
        cache = huge_pages.zeros(shape, fmt.storage_dtype(dtype)) \
            if torch.device(device).type == "cpu" and not pin_memory else None
        if cache is None:
            cache = torch.zeros(shape, dtype=fmt.storage_dtype(dtype), device=device, pin_memory=pin_memory)
        return cache.transpose(3, 4) if head_major else cache

    def move_blocks(self, batch: StepBatch) -> None:
        """The step's memory operations, before its forward: swap out (those device blocks may
        be reused in this very step), swap in, then copy-on-write. Also forgets finished sequences."""
        for seq_id in batch.finished_seq_ids:
            self.generators.pop(seq_id, None)
        if self.tier is not None and batch.tier is not None:   # first: evicted blocks, before anything overwrites them
            moves = batch.tier
            saved = {key for _, key in moves.saves}    # deletions first (a host tier reuses their room)
            self.tier.delete([key for key in moves.deletes if key not in saved])
            self.tier.save(moves.saves)
            self.tier.delete([key for key in moves.deletes if key in saved])
            self.tier.start_loads(moves.loads)
        swap_blocks(self.kv_cache, self.host_cache, batch.swap_out)
        swap_blocks(self.host_cache, self.kv_cache, batch.swap_in)
        self.copy_blocks(batch.block_copies)
        for read in batch.lora_reads:
            self.lora.prefetch(read.lora_int_id, read.path)
        for load in batch.lora_loads:
            try:
                self.lora.load(load)
            except Exception as e:   # noqa: BLE001 - its files changed on disk: its requests fail, not the step
                self.lora_errors[load.slot] = f"LoRA adapter {load.lora_int_id} ({load.path}) could not be " \
                                              f"read: {type(e).__name__}: {e}"
        if self.draft is not None:
            self.draft.move_blocks(batch)

    def forget_sequences(self) -> None:
        """Drop every sequence's state (after the engine dropped all requests)."""
        self.generators.clear()
        if self.tier is not None:
            self.tier.cancel()

    def tier_report(self, wait: Collection[bytes] = ()) -> TierReport | None:
        """The disk tier's reads that landed (those of the keys in `wait` waited for) and its news."""
        return self.tier.collect(wait) if self.tier is not None else None

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate whole blocks (all layers, K and V) before the step."""
        if copies:
            self.model.attention.copy_blocks(self.kv_cache, copies)

    @torch.inference_mode()
    def execute(self, batch: StepBatch) -> RunnerOutput:
        self.move_blocks(batch)
        seqs = batch.seqs      # decodes first, so attention can batch them
        model_drafts = {}
        if self.draft is not None:   # the draft model proposes the MODEL_DRAFT placeholders' tokens
            seqs, model_drafts = self.draft.fill_drafts(seqs)
        # Sequences with drafts sample at each of their 1 + k positions and are verified
        # (spec_decode/rejection.py); the others sample once, as ever.
        sampled_at = [i for i, s in enumerate(seqs) if s.sample is not None and not s.draft_token_ids]
        drafted_at = [i for i, s in enumerate(seqs) if s.sample is not None and s.draft_token_ids]
        sampled, drafted = [seqs[i] for i in sampled_at], [seqs[i] for i in drafted_at]
        prompt_lps, pooled = {}, {}
        logits = self._replay_decode(seqs, batch.group_block_ids)
        spec_logits = None
        if logits is None:
            input_ids, positions, meta = self._prepare(seqs, batch.group_block_ids)
            meta.batch_invariant = batch.batch_invariant
            lora = self.lora.step([s.lora_slot for s in seqs], [s.num_query_tokens for s in seqs]) \
                if self.lora is not None else None
            hidden = self.model.forward(input_ids, positions, meta, self.kv_cache, lora) if lora is not None \
                else self.model.forward(input_ids, positions, meta, self.kv_cache)
            qsl = meta.query_start_loc_cpu
            last = [qsl[i + 1] - 1 for i in sampled_at]
            spec_rows = [r for i in drafted_at for r in range(qsl[i + 1] - 1 - len(seqs[i].draft_token_ids), qsl[i + 1])]
            # None on a tensor-parallel rank but the driver (it only took part in the gather)
            # Sampled rows are one per sequence (1 + k for a drafted one): the LM head computes each
            # as a decode row, whatever the number of rows (batch-invariant greedy output).
            invariant = batch.batch_invariant
            logits = self.model.compute_logits(_rows(hidden, last), decode=True, invariant=invariant) if sampled else None
            spec_logits = self.model.compute_logits(hidden[spec_rows], decode=True, invariant=invariant) \
                if drafted else None
            prompt_lps = self._prompt_logprobs(seqs, hidden, meta)
            pooled = self._pool(seqs, hidden, meta)
        sample = None
        if logits is not None:   # on the model's device; the sampler sends ids and logprobs to the host
            sample = self.sampler(logits, [self._sampling_row(s.seq_id, s.sample) for s in sampled],
                                  batch.grammar_rows, batch.grammar_bitmask)
        spec = {}
        if spec_logits is not None:
            rows = [DraftRow(self._sampling_row(s.seq_id, s.sample), s.draft_token_ids) for s in drafted]
            spec = dict(zip([s.seq_id for s in drafted], verify(self.sampler, spec_logits.float(), rows)))
        lora_errors, self.lora_errors = self.lora_errors, {}
        return RunnerOutput([s.seq_id for s in sampled], sample, prompt_lps, pooled=pooled, spec=spec,
                            model_drafts=model_drafts, tier=self.tier_report(), lora_errors=lora_errors)

    def _replay_decode(self, seqs: list[ScheduledTokens], group_block_ids: dict[int, list[list[int]]] | None = None
                       ) -> torch.Tensor | None:
        """The logits of a step of decodes that all sample, from a captured graph; None when
        there are no graphs or the step is not one they take."""
        graphs = self.decode_graphs
        if graphs is None or not graphs.fits(len(seqs), max(len(s.block_ids) for s in seqs)) or \
                any(s.num_query_tokens != 1 or s.sample is None or s.prompt_logprobs is not None or s.lora_slot >= 0
                    for s in seqs):
            return None
        B = self.block_size
        groups = range(1, len(self.kv_groups.windows))      # KV groups past the first (sliding windows)
        tables = [[group_block_ids[s.seq_id][g - 1] for s in seqs] for g in groups]
        return graphs.run(DecodeBatch(
            token_ids=[s.token_ids[0] for s in seqs], positions=[s.start for s in seqs],
            slots=[s.block_ids[s.start // B] * B + s.start % B for s in seqs],
            seq_lens=[s.start + 1 for s in seqs], block_tables=[s.block_ids for s in seqs],
            group_slots=[[t[s.start // B] * B + s.start % B for t, s in zip(ts, seqs)] for ts in tables],
            group_tables=tables))

    def _prepare(self, batch: list[ScheduledTokens], group_block_ids: dict[int, list[list[int]]] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        return prepare_batch(batch, self.block_size, self.device, group_block_ids, self.kv_groups.windows)
    @staticmethod
    def _pool(batch: list[ScheduledTokens], hidden: torch.Tensor, meta: AttentionMetadata) -> dict:
        """Pooling requests' chunks: the hidden states (after the final norm) they need, on the host
        (the scheduler adds a MEAN request's chunk sums up): in float32, a MEAN chunk's sum in float64,
        where the float32 rows add up exactly in practice, so the sum does not depend on how the
        prompt is split into chunks."""
        out = {}
        for i, s in enumerate(batch):
            if s.pool is None:
                continue
            lo, hi = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
            rows = hidden[lo:hi].float()
            row = rows[-1] if s.pool == "LAST" else rows[0] if s.pool == "CLS" else rows.double().sum(0)
            out[s.seq_id] = row.cpu().numpy()
        return out

    def _sampling_row(self, seq_id: int, row: SampleRow) -> SamplingRow:
        generator = None
        if row.seed is not None and not row.settings.greedy:
            generator = self.generators.get(seq_id)
            if generator is None:
                generator = self.generators[seq_id] = torch.Generator(self.device).manual_seed(row.seed)
        return SamplingRow(row.settings, row.num_output_tokens, row.output_token_ids, row.prompt_token_ids,
                           generator)

    def _prompt_logprobs(self, batch: list[ScheduledTokens], hidden: torch.Tensor,
                         meta: AttentionMetadata) -> dict[int, list[PromptTokenLogprob]]:
        """For the ranges the batch names: the logprob of each prompt token given the tokens
        before it, computed from this chunk's hidden states."""
        out = {}
        for i, s in enumerate(batch):
            r = s.prompt_logprobs
            if r is None:
                continue
            k, n = r.num_logprobs, len(r.target_token_ids)
            rows = hidden[meta.query_start_loc_cpu[i]:meta.query_start_loc_cpu[i] + n]
            logits = self.model.compute_logits(rows)
            if logits is None:      # a tensor-parallel rank but the driver: it only took part in the gather
                continue
            lps = torch.log_softmax(logits, dim=-1)
            chosen = lps.gather(1, torch.tensor(r.target_token_ids, device=lps.device)[:, None])
            ranks = ((lps > chosen).sum(-1) + 1).tolist()
            top_lps, top_ids = lps.topk(k, dim=-1) if k else (lps[:, :0], lps[:, :0].long())
            out[s.seq_id] = [PromptTokenLogprob(top_ids[j].tolist(), top_lps[j].tolist(), chosen[j, 0].item(), ranks[j])
                             for j in range(n)]
        return out
