"""The worker: owns the KV cache tensor, turns a SchedulerOutput into one flat batch,
runs the model and samples.

It knows nothing of scheduling policy: it is told which tokens of which
sequences to compute, which blocks to copy first, and it reports the sampled
tokens back.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.sampling.sampler import Sampler, SamplerOutput, SamplingRow
from pagedserve.sampling_params import SamplingParams
from pagedserve.scheduler import ScheduledSeq, SchedulerOutput

# Beam search ranks candidates by the raw logprobs; the sampled token itself is unused.
_BEAM_ROW_PARAMS = SamplingParams(temperature=0.0, ignore_eos=True)


@dataclass
class RunnerOutput:
    sampled: list[ScheduledSeq]                 # the sequences that got a token, in order
    sample: SamplerOutput | None
    prompt_logprobs: dict[int, list[tuple[list[int], list[float], float, int]]]  # seq_id -> per position


def kv_cache_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                             dtype: torch.dtype) -> int:
    return num_layers * 2 * block_size * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, mapping: list[tuple[int, int]]) -> None:
    """Copy whole blocks (all layers, K and V) between the device cache and swap space."""
    if mapping:
        s, d = zip(*mapping)
        dst[:, :, list(d)] = src[:, :, list(s)].to(dst.device)


class ModelRunner:
    def __init__(self, model, num_blocks: int, block_size: int, sampler: Sampler,
                 device: torch.device = torch.device("cpu"), num_host_blocks: int = 0) -> None:
        a = model.args
        self.model = model
        self.block_size = block_size
        self.sampler = sampler
        self.device = device   # of the model, the KV cache and the batch tensors; sampling stays on the CPU
        # One tensor for all layers, indexed [layers, K/V, blocks, block_size, kv_heads, head_dim].
        # The CPU backend stores it head-major within a block (a view of [..., kv_heads,
        # block_size, head_dim]): one head's keys of a block are then 2 KB in a row, which the
        # CPU prefetches well; its kernels read strides. The others want it contiguous.
        head_major = model.attention.head_major_cache
        self.kv_cache = self._allocate(a, num_blocks, block_size, model.dtype, device, head_major)
        # Swap space (preemption_mode="swap"): the same layout in host memory (pinned, next to a GPU).
        self.host_cache = self._allocate(a, num_host_blocks, block_size, model.dtype, torch.device("cpu"), head_major,
                                         pin_memory=torch.device(device).type == "cuda")

    @staticmethod
    def _allocate(a, num_blocks: int, block_size: int, dtype: torch.dtype, device, head_major: bool,
                  pin_memory: bool = False) -> torch.Tensor:
        inner = (a.num_kv_heads, block_size) if head_major else (block_size, a.num_kv_heads)
        cache = torch.zeros(a.num_layers, 2, num_blocks, *inner, a.head_dim, dtype=dtype, device=device,
                            pin_memory=pin_memory)
        return cache.transpose(3, 4) if head_major else cache

    def move_blocks(self, sched: SchedulerOutput) -> None:
        """The step's memory operations, before its forward: swap out (those device blocks may
        be reused in this very step), swap in, then copy-on-write."""
        swap_blocks(self.kv_cache, self.host_cache, sched.swap_out)
        swap_blocks(self.host_cache, self.kv_cache, sched.swap_in)
        self.copy_blocks(sched.block_copies)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate whole blocks (all layers, K and V) before the step."""
        if copies:
            self.model.attention.copy_blocks(self.kv_cache, copies)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        self.move_blocks(sched)
        # Decodes (one new token) first, so attention can batch them.
        batch = sorted(sched.scheduled, key=lambda s: s.num_new_tokens != 1)
        input_ids, positions, meta = self._prepare(batch)
        hidden = self.model.forward(input_ids, positions, meta, self.kv_cache)

        last = [meta.query_start_loc_cpu[i + 1] - 1 for i, s in enumerate(batch) if s.samples]
        sampled = [s for s in batch if s.samples]
        sample = None
        if sampled:
            logits = self.model.compute_logits(hidden[last]).cpu()
            sample = self.sampler(logits, [self._sampling_row(s) for s in sampled])
        prompt_lps = self._prompt_logprobs(batch, hidden, meta)
        return RunnerOutput(sampled, sample, prompt_lps)

    def _prepare(self, batch: list[ScheduledSeq]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        B = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        qsl = [0]
        seq_lens = []
        tables = []
        for s in batch:
            start, end = s.start, s.start + s.num_new_tokens
            table = s.block_ids
            ids.extend(s.seq.token_ids[start:end])
            rng = range(start, end)
            pos.extend(rng)
            slots.extend(table[p // B] * B + p % B for p in rng)
            qsl.append(qsl[-1] + s.num_new_tokens)
            seq_lens.append(end)
            tables.append(table)
        width = max(len(t) for t in tables)
        dev = self.device
        block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long, device=dev)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.long, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.long, device=dev),
            block_tables=block_tables,
            num_decodes=sum(1 for s in batch if s.num_new_tokens == 1),
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens,
            max_seq_len=max(seq_lens),
        )
        return torch.tensor(ids, dtype=torch.long, device=dev), torch.tensor(pos, dtype=torch.long, device=dev), meta

    @staticmethod
    def _sampling_row(s: ScheduledSeq) -> SamplingRow:
        req, seq = s.request, s.seq
        if req.is_beam_search:
            return SamplingRow(_BEAM_ROW_PARAMS, req.prompt_token_ids, seq.output_token_ids, None,
                               num_logprobs=req.params.beam_width, needs_logprob=True)
        p = req.params
        return SamplingRow(p, req.prompt_token_ids, seq.output_token_ids, seq.generator,
                           num_logprobs=p.logprobs or 0, needs_logprob=p.needs_logprobs)

    def _prompt_logprobs(self, batch: list[ScheduledSeq], hidden: torch.Tensor, meta: AttentionMetadata):
        """For requests that asked for prompt_logprobs: the logprob of each prompt token
        given the tokens before it, computed from this chunk's hidden states."""
        out = {}
        for i, s in enumerate(batch):
            k = getattr(s.request.params, "prompt_logprobs", None)
            n_prompt = s.seq.num_prompt_tokens
            if k is None or s.start >= n_prompt - 1 or s.request.prompt_logprobs is None \
                    or len(s.request.prompt_logprobs) != s.start + 1:
                continue   # not wanted, already past the prompt, or already recorded
            end = min(s.start + s.num_new_tokens, n_prompt - 1)
            rows = hidden[meta.query_start_loc_cpu[i]:meta.query_start_loc_cpu[i] + end - s.start]
            lps = torch.log_softmax(self.model.compute_logits(rows).cpu(), dim=-1)
            targets = torch.tensor(s.seq.token_ids[s.start + 1:end + 1])
            chosen = lps.gather(1, targets[:, None])
            ranks = ((lps > chosen).sum(-1) + 1).tolist()
            top_lps, top_ids = lps.topk(k, dim=-1) if k else (lps[:, :0], lps[:, :0].long())
            out[s.seq.seq_id] = [
                (top_ids[j].tolist(), top_lps[j].tolist(), chosen[j, 0].item(), ranks[j])
                for j in range(end - s.start)]
        return out
