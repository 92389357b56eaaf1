"""Method draft_model: a smaller model with the target's vocabulary proposes the drafts.

The worker loads it beside the target (worker/worker.py). It has its own KV tensors, for its
own layers and heads, indexed by the SAME block ids and slots as the target's: one block table
per sequence covers both, so the scheduler's block manager, copy-on-write, swapping and prefix
caching move both at once (the KV cache's size counts both per block). The scheduler decides
everything: per sequence, which tokens the draft model has not seen yet (its KV lags while
drafts are off, and by one token after a step that accepted every draft) and how many drafts
to propose (MODEL_DRAFT placeholders in draft_token_ids). In the step, before the target's
forward:
1. one batched pass of the draft model over each sequence's unseen tokens (prefill chunks
   included: a prompt's draft KV is computed in the same step as the target's);
2. for the sequences that speculate, k - 1 one-token greedy steps, all sequences batched.
The drafts are greedy (the draft's argmax), a deterministic proposal: q is a point mass, and the
rejection sampler (rejection.py: accept with p(d), else sample p without d, renormalised) keeps
sampled output exactly the target's distribution without the draft's probabilities; greedy
output is plain decoding's whatever the draft proposes. The draft's KV only decides what is
proposed, never what is emitted.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from pagedserve.attention.kv_format import kv_format
from pagedserve.batch import MODEL_DRAFT, ScheduledTokens, StepBatch
from pagedserve.worker.model_runner import ModelRunner, prepare_batch, swap_blocks


class DraftModel:
    def __init__(self, model, num_blocks: int, block_size: int, device: torch.device,
                 num_host_blocks: int = 0) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        head_major = model.attention.head_major_cache
        fmt = getattr(model.attention, "kv_format", kv_format("auto"))
        self.kv_cache = ModelRunner._allocate(model.args, num_blocks, block_size, model.dtype, device, head_major, fmt)
        self.host_cache = ModelRunner._allocate(model.args, num_host_blocks, block_size, model.dtype,
                                                torch.device("cpu"), head_major, fmt,
                                                pin_memory=torch.device(device).type == "cuda")

    def move_blocks(self, batch: StepBatch) -> None:
        """The step's block moves, as the target's (same block ids): swap out, swap in, copy."""
        swap_blocks(self.kv_cache, self.host_cache, batch.swap_out)
        swap_blocks(self.host_cache, self.kv_cache, batch.swap_in)
        if batch.block_copies:
            self.model.attention.copy_blocks(self.kv_cache, batch.block_copies)

    @torch.inference_mode()
    def fill_drafts(self, seqs: list[ScheduledTokens]) -> tuple[list[ScheduledTokens], dict[int, list[int]]]:
        """Run the draft model's part of the step; returns the batch with the MODEL_DRAFT
        placeholders replaced by its proposals (same order), and the proposals by seq id."""
        fed = [s for s in seqs if s.draft_input_ids]
        assert all(s.draft_input_ids for s in seqs if s.draft_token_ids and s.draft_token_ids[0] == MODEL_DRAFT), \
            "a sequence asks for draft-model drafts without the draft model's tokens"
        if not fed:
            return seqs, {}
        # One pass over every sequence's unseen tokens (decodes first, as attention wants them).
        fed.sort(key=lambda s: len(s.draft_input_ids) != 1)
        rows = [ScheduledTokens(s.seq_id, s.draft_input_ids, s.draft_start, s.block_ids) for s in fed]
        wanted = [i for i, s in enumerate(fed) if s.draft_token_ids and s.draft_token_ids[0] == MODEL_DRAFT]
        tokens = self._forward(rows, wanted)
        drafts = {fed[i].seq_id: [t] for i, t in zip(wanted, tokens)}
        # Then one token at a time: draft j at its position gives draft j + 1.
        speculating = [fed[i] for i in wanted]
        for j in range(1, max((len(s.draft_token_ids) for s in speculating), default=0)):
            step = [s for s in speculating if len(s.draft_token_ids) > j]
            rows = [ScheduledTokens(s.seq_id, [drafts[s.seq_id][-1]], s.start + len(s.token_ids) - 1 + j, s.block_ids)
                    for s in step]
            for s, t in zip(step, self._forward(rows, list(range(len(rows))))):
                drafts[s.seq_id].append(t)
        out = [replace(s, draft_token_ids=drafts[s.seq_id]) if s.seq_id in drafts else s for s in seqs]
        return out, drafts

    def _forward(self, rows: list[ScheduledTokens], sample_at: list[int]) -> list[int]:
        """The draft model's forward over rows (writing its KV); its argmax after the last
        token of each row in sample_at."""
        input_ids, positions, meta = prepare_batch(rows, self.block_size, self.device)
        hidden = self.model.forward(input_ids, positions, meta, self.kv_cache)
        if not sample_at:
            return []
        qsl = meta.query_start_loc_cpu
        logits = self.model.compute_logits(hidden[[qsl[i + 1] - 1 for i in sample_at]])
        return logits.argmax(-1).tolist()
