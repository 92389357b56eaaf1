"""Iteration-level scheduling: which tokens of which sequences run in the next step.

One rule covers prefill and decode: every sequence has a count of computed
tokens that catches up with its token count. Each step, running requests go
first (decodes, then unfinished chunked prefills), then waiting requests in
arrival order, all under `max_num_seqs` and a token budget
(`max_num_batched_tokens`); a prompt longer than what is left of the budget is
split over several steps (chunked prefill). Short prefills beside long ones (vLLM's
`long_prefill_token_threshold`, off at 0): a prefill computes at most the threshold in a step,
and a waiting prompt with more than it left after its prefix-cache hits (long) keeps its place
while `max_long_partial_prefills` long ones are in progress, so that shorter prompts (a chat
turn mostly cached in the pool or the tier) are admitted past it instead of queueing behind long
chunks; `max_num_partial_prefills` bounds the prompts in progress. Admission control: while others run, a new
prompt waits if admitting it would leave fewer than `admission_watermark` of the blocks free
(room for the running requests to grow into). When a running request needs a
block and none is free, the most recently admitted request is preempted, with all
its sequences at once. By recompute (the default): its blocks are freed and it goes
back to the front of the waiting queue, to be recomputed (its prefix may still be in
the prefix cache). By swap: its blocks are copied to host memory and it waits in
`swapped` until they fit on the device again; swapped requests come back before any
waiting request is admitted. When swap space is short, preemption falls back to
recompute.

After the worker has run a step, `update_from_output` applies its result: computed
counts advance, sampled tokens are appended, stop conditions are checked, beams are
forked and pruned, and finished sequences and requests let go of their blocks. The
scheduler is the one owner of a sequence's life; the engine only drives steps and builds
outputs. What the worker receives is `SchedulerOutput.batch`, plain data (batch.py).

Requests with several sequences (parallel sampling, beam search) advance in
lock step: each sequence first catches up to one token short of its end, then
all compute their last token in the same step, so they sample together.
A parallel-sampling request runs as one sequence until only the last prompt
token is left, then forks into best_of sequences sharing the prompt's blocks.

Liveness: the oldest running request (the head of `running`, which is in admission
order) computes at least one token in every step until it finishes, and a step with
unfinished requests never schedules nothing. Why:
1. `add_request` refuses a request that could not run alone: it needs at most
   `num_blocks` blocks at its largest (the KV cache's `check_request`) and at most
   `max_num_seqs` sequences, and
   `max_num_batched_tokens >= max_num_seqs` (EngineConfig).
2. The head is planned first, before anything is scheduled, with the token budget less
   what the other running requests' decodes reserve. Running requests claim at most
   `max_num_seqs` sequences in all, so that leaves at least the head's own sequences,
   and a running request always has a token to compute: its plan is never empty.
3. If blocks are short, waiting requests' holds on landed disk-tier reads are dropped (kv/tier.py),
   then the other running requests are preempted, newest first. Once all are gone the head
   holds every block in use and, by 1, still fits: it is never its own victim, and nothing
   can preempt it (scheduled requests are never victims). So it computes a token, and, never
   preempted, never loses one: it finishes within as many steps as it has tokens to compute.
4. With nothing running, the oldest swapped request is swapped in, or else the first
   waiting one admitted, with the whole pool (others' tier holds dropped) and budget: by 1,
   it fits (no prefill is in progress then, so neither partial-prefill limit holds it back). (A request whose
   grammar is still compiling is passed over, keeping its place; a compile ends, and then
   the request is admitted like any other, or failed by the engine if it did not compile.
   Admission control holds a new prompt back only while others run: the watermark is not
   applied then.)
5. A failed admission leaves the request exactly as it was before (no blocks, and a
   group rejoins its leader, as after preemption by recompute), so failing never
   turns a request into one that can no longer fit.
So the head finishes, the next-oldest becomes the head, and by induction every
request finishes. tests/test_scheduler.py checks 2-4 after every step of the fuzzer's
runs (`test_the_oldest_request_advances_every_step`).
"""
from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Collection, Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

from pagedserve.batch import (MODEL_DRAFT, PromptLogprobsRange, PromptTokenLogprob, RunnerOutput, SampleRow,
                              SamplerOutput, ScheduledTokens, StepBatch, TierMoves, TierReport)
from pagedserve.config import EngineConfig
from pagedserve.errors import InvalidRequestError
from pagedserve.kv.block_pool import kv_salt
from pagedserve.kv.events import KVEventSink
from pagedserve.kv.factory import make_kv_cache_manager
from pagedserve.kv.interface import KVCache
from pagedserve.kv.memory_usage import MemoryUsage
from pagedserve.kv.tier import TierIndex, TierLink
from pagedserve.lora.adapter import LoRAReadError
from pagedserve.lora.slots import LoRASlots
from pagedserve.outputs import Logprob
from pagedserve.queue_view import QueueView
from pagedserve.request import Request, RequestStatus, Sequence, check_capacity
from pagedserve.sampling.beam_search import select_candidates
from pagedserve.sampling_params import BeamSearchParams, SamplingParams
from pagedserve.structured.manager import fill_bitmask
from pagedserve.spec_decode import ngram
from pagedserve.spec_decode.suffix import SuffixProposer
from pagedserve.spec_decode.stats import SpecDecodeCounters

logger = logging.getLogger(__name__)


@dataclass
class ScheduledSeq:
    request: Request
    seq: Sequence
    num_new_tokens: int
    block_ids: list[int]        # the sequence's block table after allocation (KV group 0's)
    start: int = 0              # first position computed (the sequence's computed count)
    samples: bool = False       # the step reaches the sequence's last token: sample from it
    draft_token_ids: list[int] = field(default_factory=list)   # speculative drafts after its last token
    draft_start: int | None = None   # method draft_model: where the draft model's tokens start (None: it skips this one)
    group_block_ids: list[list[int]] = field(default_factory=list)   # KV groups 1..'s tables (kv/groups.py)

    @property
    def num_query_tokens(self) -> int:
        """Tokens the forward computes for this sequence: its own and its drafts."""
        return self.num_new_tokens + len(self.draft_token_ids)

    @classmethod
    def of(cls, req: Request, seq: Sequence, n: int, block_ids: list[int]) -> "ScheduledSeq":
        start = seq.num_computed_tokens
        return cls(req, seq, n, block_ids, start, start + n == seq.num_tokens and req.pooling is None)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)   # (src, dst), before the step
    # Swaps, also before the step (and before the block copies): (device, host) then (host, device).
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # What the worker gets (data only), and the scheduled sequences in its sampling order.
    batch: StepBatch = field(default_factory=StepBatch)
    sampled: list[ScheduledSeq] = field(default_factory=list)
    spec: list[ScheduledSeq] = field(default_factory=list)   # those with drafts, in the batch's order

    @property
    def empty(self) -> bool:
        return not self.scheduled


@dataclass
class SchedulerCounters:
    """Cumulative counters of the scheduler (engine/stats.py's SchedulerStats is the snapshot
    stat loggers receive)."""
    num_preemptions: int = 0
    num_recomputed_tokens: int = 0     # computed tokens thrown away by preemption
    # Block tables' entries and physical blocks in use, summed over steps: their ratio is
    # the run's sharing saving as the paper measures it (blocks saved / blocks needed).
    logical_block_steps: int = 0
    physical_block_steps: int = 0
    spec: SpecDecodeCounters = field(default_factory=SpecDecodeCounters)

    @property
    def sharing_saving_avg(self) -> float:
        logical = self.logical_block_steps
        return (logical - self.physical_block_steps) / logical if logical else 0.0


@dataclass
class StepUpdate:
    """What one step did to the requests, for the engine's outputs."""
    progressed: list[Request] = field(default_factory=list)   # got tokens this step, in order
    finished: set[str] = field(default_factory=set)            # ids of those now finished and removed
    failed: dict[str, Exception] = field(default_factory=dict)   # ids of requests dropped (blocks freed)


Plan = list[tuple[Sequence, int]]


class Scheduler:
    def __init__(self, config: EngineConfig, num_blocks: int, max_model_len: int | None = None,
                 num_host_blocks: int = 0, eos_token_ids: Collection[int] = (),
                 kv_events: KVEventSink | None = None, tier: TierIndex | None = None,
                 kv_windows: Seq[int | None] = (None,), batch_dependent_steps: bool = True) -> None:
        """eos_token_ids: every EOS id of the model (tokenizer and generation config), for
        sampling and beam search alike; kv_events: told of the prefix cache's changes (a
        data-parallel router listens). The scheduler knows no text: the engine's output side
        makes it and checks the stop strings (engine/detokenizer.py), then ends a sequence a
        stop string ended with `stop_seq`. tier: the keys of the disk tier below the prefix
        cache (kv/tier.py), kept by the engine across resets. kv_windows: the model's KV groups'
        sliding windows (kv/groups.py; None: full attention), each group with its own block tables.
        batch_dependent_steps: the worker's report that a step which is not batch-invariant computes
        other arithmetic (else no block is marked batch-dependent: a greedy request takes them all)."""
        self.config = config
        self.batch_dependent_steps = batch_dependent_steps
        self.block_size = config.block_size
        self.max_model_len = max_model_len or config.max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.kv: KVCache = make_kv_cache_manager(config.kv_allocator, num_blocks, config.block_size,
                                                 config.enable_prefix_caching, self.max_model_len, num_host_blocks,
                                                 kv_events, config.kv_cache_dtype, tier, kv_windows,
                                                 config.max_num_batched_tokens, config.enable_partial_block_caching)
        # The tier below the prefix cache: a waiting request whose prefix it holds waits for
        # its reads (passed over like a compiling grammar), at most twice (_tier_tries).
        self.tier: TierLink | None = getattr(self.kv, "tier", None)
        self._tier_tries: dict[str, int] = {}
        self._tier_deferred: set[str] = set()    # read ahead when the pool has room (_read_ahead)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()     # preempted by swap, by arrival (oldest first)
        # Admission control: blocks a new prompt must leave free while others run. Only for the
        # paged cache: the baselines reserve a request's final size up front and never grow.
        self.watermark_blocks = int(config.admission_watermark * num_blocks) if config.kv_allocator == "paged" else 0
        self.stats = SchedulerCounters()
        self.queues = QueueView(self)
        self._next_seq_id = 0
        self._warned_preemption = False
        self._finished_seq_ids: list[int] = []   # for the next batch: the worker forgets them
        # Speculative decoding (spec_decode/): this step's drafts by seq id (set by _plan) and
        # whether drafts are on in this step (off above disable_by_batch_size running requests).
        self.spec_config = config.speculative_config
        self._drafts: dict[int, list[int]] = {}
        self._spec_on = False
        spec = self.spec_config
        self.suffix = SuffixProposer(spec.suffix_decoding_max_tree_depth, spec.suffix_decoding_max_cached_requests,
                                     spec.suffix_decoding_max_spec_factor, spec.suffix_decoding_min_token_prob) \
            if spec is not None and spec.method == "suffix" else None
        # Method draft_model: the worker's draft model keeps its own KV in the same blocks (same
        # slots); per sequence, how many leading positions of it are valid. It lags the target's
        # while drafts are off, and by one token after a step whose drafts were all accepted (the
        # last draft was never fed to the draft model); the next step's draft tokens catch up.
        self.draft_model = spec is not None and spec.method == "draft_model"
        self._draft_valid: dict[int, int] = {}
        # Multi-LoRA (lora/slots.py): which adapter each device slot holds and who uses it.
        self.loras = LoRASlots(config.max_loras, config.max_cpu_loras) if config.enable_lora else None

    # ---- requests in and out ---------------------------------------------------------------
    def new_seq_id(self) -> int:
        self._next_seq_id += 1
        return self._next_seq_id

    def add_request(self, req: Request) -> None:
        """check_request, then queue_request (the simulators' and tests' way in)."""
        self.check_request(req)
        self.queue_request(req)

    def check_request(self, req: Request) -> None:
        """The checks that only the scheduler and the KV cache can make (of their sizes, not their
        state): InvalidRequestError for a request that could never run (more sequences than
        max_num_seqs, more blocks than the cache holds)."""
        check_capacity(req.params, len(req.prompt_token_ids), req.max_tokens, self.config.max_num_seqs, self.kv.fit)

    def queue_request(self, req: Request) -> None:
        """Queue a request check_request passed (LLMEngine.check_request runs it once per request)."""
        self.waiting.append(req)

    def free_seq(self, seq: Sequence, req: Request) -> None:
        self.kv.free(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
        self._draft_valid.pop(seq.seq_id, None)
        self._finished_seq_ids.append(seq.seq_id)
        if req.structured is not None:
            req.structured.drop(seq.seq_id)

    def fork_seq(self, req: Request, parent: Sequence) -> Sequence:
        child = req.fork_seq(parent, self.new_seq_id(), index=len(req.seqs))
        self.kv.fork(parent.seq_id, child.seq_id)
        self._copy_draft_valid(parent, child)
        if req.structured is not None:
            req.structured.fork(parent.seq_id, child.seq_id)
        return child

    def stop_seq(self, req: Request, seq: Sequence, stop_reason: str) -> bool:
        """End a live sequence that a stop string in its text ended (the engine's output side
        found it after update_from_output): its blocks are freed. Returns whether that finished
        the request, which is then removed as update_from_output removes finished ones."""
        seq.finish_reason, seq.stop_reason = "stop", stop_reason
        self.free_seq(seq, req)
        if req.live_seqs:
            return False
        self.finish_request(req)
        return True

    def finish_request(self, req: Request) -> None:
        """Remove a request (finished or aborted) from the queues and free all its blocks."""
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status == RequestStatus.WAITING:
            self.waiting.remove(req)
        elif req.status == RequestStatus.SWAPPED:
            self.swapped.remove(req)
        self._release_lora(req)
        for seq in req.seqs:
            self.kv.free(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
            self._draft_valid.pop(seq.seq_id, None)
            self._finished_seq_ids.append(seq.seq_id)
            if self.suffix is not None and seq.finish_reason != "abort":
                # suffix drafts for later requests of its tenant and adapter (its KV salt) only
                self.suffix.add_output(seq.output_token_ids, kv_salt(req.cache_salt, req.lora_key))
        if self.tier is not None:
            self.tier.release(req.request_id)
            self._tier_tries.pop(req.request_id, None)
            self._tier_deferred.discard(req.request_id)
        if req.structured is not None:
            req.structured.release()   # a compile only it waited for is abandoned
        req.structured = None   # its matchers go with it
        req.status = RequestStatus.FINISHED

    def abort_request(self, req: Request) -> None:
        """End a request early (abort, or a failure in its part of a step): its sequences finish "abort", its blocks freed."""
        if req.finished:
            return
        for seq in req.live_seqs:
            seq.finish_reason = "abort"
        self.finish_request(req)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    # ---- the step --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._drafts = {}
        spec = self.spec_config
        self._spec_on = spec is not None and len(self.running) <= spec.disable_by_batch_size
        budget = self.config.max_num_batched_tokens
        scheduled: set[int] = set()

        # The oldest request first (it alone may preempt any other: the liveness argument
        # above), leaving budget for the others' decodes; then decodes (one token per
        # sequence), then chunked prefills still in progress.
        head, rest = self.running[:1], sorted(self.running[1:], key=lambda r: not self._is_decoding(r))
        reserve = sum(r.max_seqs for r in rest if self._is_decoding(r))
        for req in head + rest:
            if req.status != RequestStatus.RUNNING or budget == 0:
                continue
            self._fork_if_ready(req)
            plan = self._plan(req, budget - reserve if req in head else budget)
            if not plan:
                continue
            while (copies := self._allocate(plan)) is None:
                if self.tier is not None and self.tier.drop_landed():
                    continue       # waiting requests' landed tier reads give way first: no preemption for them
                victim = next(r for r in reversed(self.running) if id(r) not in scheduled)
                self._preempt(victim, out)
                if victim is req:
                    break
            if copies is None:
                continue
            scheduled.add(id(req))
            budget -= self._add(out, req, plan, copies)

        # Swapped-out requests come back, oldest first, once their blocks fit again.
        num_seqs = sum(r.max_seqs for r in self.running)
        while self.swapped and not out.preempted:
            req = self.swapped[0]
            if num_seqs + req.max_seqs > self.config.max_num_seqs or not self._swap_in(req, out):
                break
            num_seqs += req.max_seqs
            if budget > 0:
                self._fork_if_ready(req)
            plan = self._plan(req, budget) if budget > 0 else []
            copies = self._allocate(plan) if plan else None
            if copies is not None:
                scheduled.add(id(req))
                budget -= self._add(out, req, plan, copies)

        # Then waiting requests, first come first served, while nothing had to be preempted
        # and nothing waits in swap space (it would starve). One whose grammar is still
        # compiling, or whose LoRA adapter has no slot (all max_loras hold adapters that
        # admitted requests use), keeps its place and is passed over.
        compiling: list[Request] = []
        prefilling = [r for r in self.running if not self._is_decoding(r)]
        num_prefills, num_long = len(prefilling), sum(self._is_long(r) for r in prefilling)
        while self.waiting and budget > 0 and not out.preempted and not self.swapped:
            req = self.waiting[0]
            if req.waiting_for_grammar or (req.lora is not None and not self.loras.can_acquire(req.lora)):
                compiling.append(self.waiting.popleft())
                continue
            if req.lora is not None and self.running and not self.loras.ready(req.lora):
                self.loras.request_read(req.lora)     # read in the background this step, admitted after
                compiling.append(self.waiting.popleft())
                continue
            if num_seqs + req.max_seqs > self.config.max_num_seqs:
                break
            if self.tier is not None and self._wait_for_tier(req):
                compiling.append(self.waiting.popleft())
                continue
            if 0 < self.config.max_num_partial_prefills <= num_prefills:
                break
            threshold = self.config.long_prefill_token_threshold
            hit = None      # with a threshold: the lookup that classifies the request, admitted with it
            if threshold > 0:
                left, hit = self._left_after_hits(req)
                long = threshold < left
            else:
                long = False
            if long and num_long >= self.config.max_long_partial_prefills:
                compiling.append(self.waiting.popleft())   # a long slot frees up: it comes first again
                continue
            admitted = self._admit(req, budget, hit)
            if admitted is None and self.tier is not None and self.tier.drop_landed(keep=req.request_id):
                admitted = self._admit(req, budget)     # holds of requests behind never keep it out
            if admitted is None:
                break          # out of blocks: stop admitting
            plan, copies = admitted
            if req.lora is not None:
                req.lora_slot = self.loras.acquire(req.lora)
            self.waiting.popleft()
            self.running.append(req)
            req.status = RequestStatus.RUNNING
            num_seqs += req.max_seqs
            num_prefills, num_long = num_prefills + 1, num_long + long
            budget -= self._add(out, req, plan, copies)
        self.waiting.extendleft(reversed(compiling))
        if self.tier is not None and self.config.kv_offload_read_ahead and not out.preempted and not self.swapped:
            self._read_ahead()
        self._record_usage()
        self._make_batch(out)
        return out

    def _batch_invariant(self, scheduled: list) -> bool:
        """Whether the step computes every row as it would be alone (config.batch_invariant;
        auto: it holds a greedy request, whose output users expect to reproduce)."""
        mode = self.config.batch_invariant
        if mode != "auto":
            return mode == "on"
        return any(s.request.sampling is not None and s.request.sampling.greedy for s in scheduled)

    def _needs_invariant_blocks(self, req: Request) -> bool:
        """A greedy request under auto reads only cached KV that batch-invariant steps computed, as
        it computes its own: else a prefix computed in a step of sampled requests only changes
        its tokens ("on" computes every block so, "off" promises nothing)."""
        return self.config.batch_invariant == "auto" and req.sampling is not None and req.sampling.greedy

    def _make_batch(self, out: SchedulerOutput) -> None:
        """The worker's copy of the step: data only, decodes first (attention batches them), then
        verification chunks (a decode and its drafts: attended row by row as decodes), then prefills."""
        made = []
        for s in out.scheduled:
            seq = s.seq
            end = s.start + s.num_new_tokens
            if self.draft_model and self._spec_on and s.request.pooling is None and self._may_speculate(s.request):
                s.draft_start = min(self._draft_valid.get(seq.seq_id, 0), s.start)
            made.append((ScheduledTokens(
                seq.seq_id, seq.token_ids[s.start:end], s.start, s.block_ids,
                self._sample_row(s.request, seq) if s.samples else None,
                self._prompt_logprobs_range(s) if s.request.prompt_logprobs is not None else None,
                pool=self._pool_kind(s), draft_token_ids=list(s.draft_token_ids),
                draft_input_ids=seq.token_ids[s.draft_start:end] if s.draft_start is not None else [],
                draft_start=s.draft_start or 0, lora_slot=s.request.lora_slot,
                embeds=s.request.pooling is not None), s))
        made.sort(key=lambda m: 0 if m[0].is_decode else 1 if m[0].draft_token_ids else 2)   # (stable)
        seqs, order = [m[0] for m in made], [m[1] for m in made]
        out.sampled = [s for s in order if s.samples and not s.draft_token_ids]
        out.spec = [s for s in order if s.draft_token_ids]
        out.batch = StepBatch(seqs, out.swap_out, out.swap_in, out.block_copies, self._finished_seq_ids,
                              batch_invariant=self._batch_invariant(order))
        if self.batch_dependent_steps and not out.batch.batch_invariant and order:   # none a greedy one takes
            self.kv.mark_batch_dependent([(s.seq.seq_id, s.start) for s in order])
        if self.kv.num_groups > 1:
            out.batch.group_block_ids = {s.seq.seq_id: s.group_block_ids for s in order}
        if self.loras is not None:
            out.batch.lora_loads = self.loras.take_loads()
            out.batch.lora_reads = self.loras.take_reads()
        if self.tier is not None:
            saves, loads, deletes = self.tier.take()
            wait = self.tier.awaited(r.request_id for r in self.waiting) if not out.scheduled else []  # nothing runs
            if saves or loads or deletes or wait:
                out.batch.tier = TierMoves(saves, deletes, loads, wait)
        self._finished_seq_ids = []
        constrained = [(row, s) for row, s in enumerate(out.sampled) if s.request.structured is not None]
        if constrained:
            out.batch.grammar_rows = [row for row, _ in constrained]
            out.batch.grammar_bitmask = fill_bitmask([(s.request.structured, s.seq.seq_id, s.seq.output_token_ids)
                                                      for _, s in constrained])

    @staticmethod
    def _sample_row(req: Request, seq: Sequence) -> SampleRow:
        """A seeded request's sequence i samples with seed + i: each output reproducible alone."""
        settings = req.sampling
        seed = getattr(req.params, "seed", None)
        return SampleRow(settings, None if seed is None else seed + seq.index, seq.num_output_tokens,
                         seq.output_token_ids if settings.needs_output_token_ids else None,
                         req.prompt_token_ids if settings.repetition_penalty != 1.0 else None)

    @staticmethod
    def _pool_kind(s: ScheduledSeq) -> str | None:
        """What the worker pools of a pooling request's chunk (batch.py's ScheduledTokens.pool)."""
        kind = s.request.pooling
        if kind == "LAST" and s.start + s.num_new_tokens < s.seq.num_tokens:
            return None
        if kind == "CLS" and s.start != 0:
            return None
        return kind

    def _pool_step(self, s: ScheduledSeq, pooled: dict) -> None:
        """Fold a pooling chunk's result into its request; the prompt computed, it finishes."""
        req, seq = s.request, s.seq
        if s.start == 0:
            req.pooled = None    # computed afresh (first time, or after a preemption by recompute)
        row = pooled.get(seq.seq_id)
        if row is not None:
            req.pooled = row if req.pooled is None or req.pooling != "MEAN" else req.pooled + row
        if seq.num_computed_tokens >= seq.num_tokens:
            seq.finish_reason = "stop"
            self.free_seq(seq, req)

    @staticmethod
    def _prompt_logprobs_range(s: ScheduledSeq) -> PromptLogprobsRange | None:
        """Prompt positions this chunk scores: those not yet recorded, up to the prompt's
        second-to-last (the last one's next token is generated, not part of the prompt)."""
        req, seq = s.request, s.seq
        n_prompt = seq.num_prompt_tokens
        if seq is not req.seqs[0] or s.start >= n_prompt - 1 or len(req.prompt_logprobs) != s.start + 1:
            return None
        end = min(s.start + s.num_new_tokens, n_prompt - 1)
        k = getattr(req.params, "prompt_logprobs", None) or 0
        return PromptLogprobsRange(k, seq.token_ids[s.start + 1:end + 1])

    def _record_usage(self) -> None:
        self.stats.logical_block_steps += self.kv.num_logical_blocks
        self.stats.physical_block_steps += self.kv.num_used_blocks

    def _add(self, out: SchedulerOutput, req: Request, plan: Plan, copies: list) -> int:
        out.block_copies.extend(copies)
        added = [ScheduledSeq.of(req, s, n, self.kv.block_ids(s.seq_id)) for s, n in plan]
        for x in added:
            x.draft_token_ids = self._drafts.get(x.seq.seq_id, [])
            if self.kv.num_groups > 1:
                x.group_block_ids = self.kv.group_block_ids(x.seq.seq_id)
        out.scheduled.extend(added)
        return sum(x.num_query_tokens for x in added)

    def _copy_draft_valid(self, parent: Sequence, child: Sequence) -> None:
        """A forked sequence shares its parent's blocks: the draft model's KV in them too."""
        if parent.seq_id in self._draft_valid:
            self._draft_valid[child.seq_id] = self._draft_valid[parent.seq_id]

    def _is_decoding(self, req: Request) -> bool:
        return all(s.num_computed_tokens >= s.num_tokens - 1 for s in req.live_seqs)

    def _is_long(self, req: Request) -> bool:
        """A running prefill with more than long_prefill_token_threshold tokens left (never, at 0)."""
        seq = req.live_seqs[0]
        return 0 < self.config.long_prefill_token_threshold < seq.num_tokens - seq.num_computed_tokens

    def _left_after_hits(self, req: Request) -> tuple[int, Any]:
        """The tokens a waiting request would compute after its prefix-cache hits (its first
        sequence's), and the hit for _admit (None: no lookup); the lookup changes nothing."""
        seq = req.live_seqs[0]
        tokens = seq.token_ids[:len(req.prompt_token_ids)] if req.leader_only else seq.token_ids
        if req.computes_every_prompt_token:
            return len(tokens), None
        cached, hit = self.kv.cached_prefix(tokens, kv_salt(req.cache_salt, req.lora_key),
                                            self._needs_invariant_blocks(req))
        return len(tokens) - cached, hit

    def _plan(self, req: Request, budget: int) -> Plan:
        """How many tokens each live sequence of the request computes this step (changes nothing)."""
        live = req.live_seqs
        for seq in live:
            self._drafts.pop(seq.seq_id, None)
        chunk = min(budget, self.config.long_prefill_token_threshold or budget)   # a prefill's most a step
        if req.leader_only:
            leader = live[0]
            short = leader.num_prompt_tokens - 1 - leader.num_computed_tokens
            assert short > 0, "_fork_if_ready attaches the followers first"
            return [(leader, min(short, chunk))]
        if len(live) == 1:
            seq = live[0]
            n = min(seq.num_tokens - seq.num_computed_tokens, chunk)
            if n == 1 and seq.num_tokens - seq.num_computed_tokens == 1:
                self._propose(req, seq, budget - 1)
            return [(seq, n)] if n > 0 else []
        plan: Plan = []
        for seq in live:   # catch up to one token short of the end
            n = min(seq.num_tokens - 1 - seq.num_computed_tokens, budget, chunk)
            if n > 0:
                plan.append((seq, n))
                budget -= n
        if plan or len(live) > budget:
            return plan
        room = budget - len(live)
        for seq in live:
            room -= len(self._propose(req, seq, room // len(live)))
        return [(seq, 1) for seq in live]   # all sample together

    def _propose(self, req: Request, seq: Sequence, room: int) -> list[int]:
        """Speculative drafts for a decoding sequence, at most `room` of them (the token budget's
        share), none for a request that may not have them; recorded for this step."""
        spec = self.spec_config
        if not self._spec_on or room <= 0 or not self._may_speculate(req):
            return []
        k = min(spec.num_speculative_tokens, room, req.max_tokens - seq.num_output_tokens - 1)
        if k <= 0:
            return []
        if self.draft_model:   # the worker's draft model fills these slots
            drafts = [MODEL_DRAFT] * k
        elif self.suffix is not None:
            drafts = self.suffix.propose(seq.token_ids, k, kv_salt(req.cache_salt, req.lora_key))
        else:
            drafts = ngram.propose(seq.token_ids, k, spec.prompt_lookup_min, spec.prompt_lookup_max)
        if drafts:
            self._drafts[seq.seq_id] = drafts
        return drafts

    def _may_speculate(self, req: Request) -> bool:
        """Not for beam search or structured output (drafts would need the grammar's check first),
        nor for a best_of request with stop strings and no logprobs (tokens past a stop string in
        one step are dropped, and its ranking logprob could not drop theirs), nor for a request
        whose drafts have mostly been wrong."""
        p = req.params
        if req.is_beam_search or req.structured is not None:
            return False
        if p.stop_strings and p.best_of > p.n and p.logprobs is None:
            return False
        spec, c = self.spec_config, req.spec
        return c.num_drafts < spec.min_acceptance_after or \
            c.num_accepted_tokens >= spec.min_acceptance * c.num_draft_tokens

    def _fork_if_ready(self, req: Request) -> None:
        """Once a leader-only group's leader has computed all but the last prompt token, the
        other sequences share its blocks from here (parallel sampling forks them now)."""
        if not req.leader_only:
            return
        leader = req.live_seqs[0]
        if leader.num_computed_tokens < leader.num_prompt_tokens - 1:
            return
        if req.pending_fork:
            for _ in range(1, req.params.best_of):
                self.fork_seq(req, leader)
            req.pending_fork = False
        else:
            for seq in req.live_seqs[1:]:
                self.kv.fork(leader.seq_id, seq.seq_id)
                self._copy_draft_valid(leader, seq)
                seq.num_computed_tokens = leader.num_computed_tokens
            req.rejoin = False

    def _allocate(self, plan: Plan) -> list[tuple[int, int]] | None:
        """Reserve the slots of a plan (with its drafts'), all or nothing; returns the
        copy-on-write copies. Drafts never cost a preemption: short of blocks, they are dropped."""
        copies = self.kv.allocate_slots([(s.seq_id, s.token_ids, s.num_computed_tokens,
                                          n + len(self._drafts.get(s.seq_id, ()))) for s, n in plan])
        if copies is None and any(s.seq_id in self._drafts for s, _ in plan):
            for s, _ in plan:
                self._drafts.pop(s.seq_id, None)
            return self._allocate(plan)
        return copies

    def _admit(self, req: Request, budget: int, hit: Any = None) -> tuple[Plan, list] | None:
        """Take prefix-cache hits, then reserve the first step's slots; undo all if short. `hit`:
        the first sequence's lookup (_left_after_hits), made this step with nothing changed since."""
        prompt_len = len(req.prompt_token_ids)
        lent = self.tier.lend(req.request_id) if self.tier is not None else None   # its held tier reads, for the lookup
        # A leader-only request shares only prompt blocks with its followers later.
        seqs = req.live_seqs[:1] if req.leader_only else req.live_seqs
        for i, seq in enumerate(seqs):
            tokens = seq.token_ids[:prompt_len] if req.leader_only else seq.token_ids
            seq.num_computed_tokens = self.kv.admit(seq.seq_id, tokens, prompt_len + req.max_tokens,
                                                    kv_salt(req.cache_salt, req.lora_key),
                                                    use_prefix_cache=not req.computes_every_prompt_token,
                                                    invariant_only=self._needs_invariant_blocks(req),
                                                    hit=hit if i == 0 and lent is None else None)
        copies = None
        if not self.running or self._above_watermark(seqs, prompt_len):
            self._fork_if_ready(req)   # prefix hits may have brought the leader that far
            plan = self._plan(req, budget)
            copies = self._allocate(plan) if plan else None
        if copies is None:
            self._release_blocks(req)
            if lent is not None:
                self.tier.keep(req.request_id, lent)   # held again (a failed allocation evicts nothing)
            return None
        if req.num_preemptions == 0:
            req.num_cached_tokens = min(req.seqs[0].num_computed_tokens, prompt_len)
            self.kv.record_prefix_lookup(prompt_len, req.num_cached_tokens)
        return plan, copies

    def _wait_for_tier(self, req: Request, reserve: int | None = None) -> bool:
        """Whether a waiting request waits for the disk tier: its reads are in flight, or its prefix
        misses the pool but hits the tier and reads start now (where its admission leaves `reserve`
        free; by default the watermark while others run). Landed reads are cached blocks it holds
        until its admission takes them. At most two reads: a prefix evicted again is computed."""
        rid = req.request_id
        if self.tier.holds(rid):
            return self.tier.waiting(rid)    # landed: held for its admission
        tries = self._tier_tries.get(rid)
        if req.computes_every_prompt_token or (tries or 0) >= 2:
            return False
        seq = req.live_seqs[0]
        tokens = seq.token_ids[:len(req.prompt_token_ids)] if req.leader_only else seq.token_ids
        if reserve is None:
            reserve = self.watermark_blocks if self.running else 0
        started = self.kv.tier_fetch(rid, tokens, kv_salt(req.cache_salt, req.lora_key), reserve,
                                     count=tries is None, invariant_only=self._needs_invariant_blocks(req))
        self._tier_tries[rid] = (tries or 0) + started
        return started

    def _read_ahead(self) -> None:
        """Start the tier reads of waiting requests the admission loop did not reach (behind running
        ones, the budget, max_num_seqs), in queue order, overlapping the others' compute; only while
        their admissions leave free the watermark, the running prompts' blocks and what the requests
        already reading or holding take (`TierLink.reserved`). Nobody reads ahead behind one whose
        hold was dropped (others' reads would evict its free cached blocks), nor behind one whose
        prefix the tier holds but whose admission does not fit yet (next step)."""
        base = self.watermark_blocks + sum(self.kv.num_blocks_to_hold(s.seq_id, len(r.prompt_token_ids))
                                           for r in self.running for s in r.live_seqs)
        for req in self.waiting:
            reserve, rid, hits = base + self.tier.reserved(), req.request_id, self.tier.index.stats.hits
            tries, holds = self._tier_tries.get(rid), self.tier.holds(rid)
            if reserve >= self.kv.num_free_blocks or (tries and not holds):
                return
            if holds or (tries == 0 and rid not in self._tier_deferred):
                continue          # reading or read (held), or nothing of its prefix in the tier
            if not self._wait_for_tier(req, reserve) and (rid in self._tier_deferred or self.tier.index.stats.hits > hits):
                self._tier_deferred.add(rid)
                return

    def apply_tier_report(self, report: TierReport) -> None:
        """The worker's news of the disk tier (`TierLink.apply`)."""
        if self.tier is not None:
            self.tier.apply(report)

    def _above_watermark(self, seqs: list[Sequence], prompt_len: int) -> bool:
        """Admission control: after the rest of these sequences' prompt blocks (beyond the
        prefix-cache hits they already hold), at least `watermark_blocks` stay free, so that
        running requests have room to grow instead of preempting each other at once."""
        needed = sum(self.kv.num_blocks_to_hold(s.seq_id, prompt_len) for s in seqs)
        return self.kv.num_free_blocks - needed >= self.watermark_blocks

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        """Evict a running request with all its sequences: to swap space if that is the mode
        and there is room for all its blocks, else by recompute."""
        self.running.remove(req)
        out.preempted.append(req)
        ids = [s.seq_id for s in req.live_seqs]
        swap_space = self.kv.swap
        swap = self.config.preemption_mode == "swap" and swap_space is not None and swap_space.can_swap_out(ids)
        if swap:
            out.swap_out.extend(swap_space.swap_out(ids))
            req.status = RequestStatus.SWAPPED
            self.swapped = deque(sorted([*self.swapped, req], key=lambda r: r.arrival_time))
        else:
            self._preempt_by_recompute(req)
        req.num_preemptions += 1
        self.stats.num_preemptions += 1
        if not self._warned_preemption:
            self._warned_preemption = True
            logger.warning(
                "Request %s was preempted (%s): all %d KV cache blocks were in use. Throughput suffers "
                "when this happens often; give the engine more kv_cache_memory or lower max_num_seqs.",
                req.request_id, "swapped to host memory" if swap else "to be recomputed", self.kv.num_blocks)

    def _preempt_by_recompute(self, req: Request) -> None:
        """Free every block of the request (and its LoRA slot) and requeue it first."""
        self.stats.num_recomputed_tokens += self._release_blocks(req)
        self._release_lora(req)
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)

    def _release_lora(self, req: Request) -> None:
        if req.lora_slot >= 0:
            self.loras.release(req.lora_slot)
            req.lora_slot = -1

    def _release_blocks(self, req: Request) -> int:
        """Free every block of the request's sequences, to be computed again from the start.
        A group with several live sequences rejoins: its leader recomputes the shared prompt
        alone, the others take its blocks back by reference. (Without that, a group whose
        admission failed after its followers forked or rejoined would have each sequence
        recompute the prompt on its own: more blocks than the group may ever need, so it
        could wait forever.) Returns the number of computed tokens thrown away."""
        thrown_away = 0
        for seq in req.live_seqs:
            thrown_away += seq.num_computed_tokens
            self.kv.free(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
            # A prefix-cache hit on readmission brings back the target's KV; the draft model's
            # in those blocks may be another sequence's: it recomputes its own.
            self._draft_valid.pop(seq.seq_id, None)
            seq.num_computed_tokens = 0
        req.rejoin = len(req.live_seqs) > 1
        return thrown_away

    def _swap_in(self, req: Request, out: SchedulerOutput) -> bool:
        """Bring a swapped request's blocks back if they fit, leaving a free block per
        sequence for its next token when others run (so it does not bounce straight back)."""
        ids = [s.seq_id for s in req.live_seqs]
        needed = self.kv.swap.num_blocks_to_swap(ids) + (len(ids) * self.kv.num_groups if self.running else 0)
        if needed > self.kv.num_free_blocks and self.tier is not None:
            self.tier.drop_landed()      # waiting requests' landed tier reads give way first
        if needed > self.kv.num_free_blocks:
            return False
        self.swapped.popleft()
        out.swap_in.extend(self.kv.swap.swap_in(ids))
        self.running.append(req)
        req.status = RequestStatus.RUNNING
        return True

    # ---- after the step ----------------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, result: RunnerOutput) -> StepUpdate:
        """Apply a step's result: computed counts advance, prompt logprobs are recorded, each
        sampled token is appended and checked against the stop conditions, beams are forked
        and pruned; finished sequences and requests free their blocks. Each request's part
        runs on its own: one that raises is dropped (its blocks freed) and reported in
        `failed`, the others' tokens are kept."""
        if result.tier is not None:
            self.apply_tier_report(result.tier)
        now = time.monotonic()
        for s in out.scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens
            if s.draft_start is not None:   # the draft model computed its KV up to here too
                self._draft_valid[s.seq.seq_id] = s.seq.num_computed_tokens
            if s.request.first_scheduled_time is None:
                s.request.first_scheduled_time = now
        if result.prompt_logprobs:
            self._record_prompt_logprobs(out, result.prompt_logprobs)

        update = StepUpdate()
        touched: dict[str, Request] = {}
        failed_loras = self._fail_lora_reads(out, result.lora_errors, update, touched)
        beams: dict[str, tuple[list[Sequence], list[int]]] = {}
        sample = result.sample
        assert result.sampled_seq_ids == [s.seq.seq_id for s in out.sampled], "the worker sampled other sequences"
        for row, s in enumerate(out.sampled):
            req = s.request
            touched[req.request_id] = req
            if req.is_beam_search:
                group = beams.setdefault(req.request_id, ([], []))
                group[0].append(s.seq)
                group[1].append(row)
            else:
                self._isolated(update, req, self._append_token, req, s.seq, sample, row)
        for rid, (seqs, rows) in beams.items():
            self._isolated(update, touched[rid], self._beam_step, touched[rid], seqs, sample, rows)
        for s in out.scheduled:   # pooling requests: prefill only, no sampling
            if s.request.pooling is not None:
                self._isolated(update, s.request, self._pool_step, s, result.pooled)
                if s.seq.finished:
                    touched[s.request.request_id] = s.request
        for s in out.spec:
            touched[s.request.request_id] = s.request
            self._isolated(update, s.request, self._append_verified, s, result.spec[s.seq.seq_id])

        now = time.monotonic()
        for rid, req in touched.items():
            if rid in update.failed:
                continue
            req.first_token_time = req.first_token_time or now
            req.last_token_time = now
            update.progressed.append(req)
            if not req.live_seqs:
                self.finish_request(req)
                update.finished.add(rid)
        for rid in update.failed:
            self.abort_request(touched[rid])
        for lora_int_id in failed_loras:      # (its slot now unused) read afresh next time
            self.loras.forget(lora_int_id)
        return update

    def _fail_lora_reads(self, out: SchedulerOutput, errors: dict[int, str], update: StepUpdate,
                         touched: dict[str, Request]) -> set[int]:
        """The requests whose adapter the worker could not read this step (lora_errors: by slot)
        fail alone, with the worker's reason; the ids of those adapters."""
        failed = set()
        for s in out.scheduled if errors else ():
            req = s.request
            if req.lora_slot in errors and req.request_id not in update.failed:
                touched[req.request_id] = req
                update.failed[req.request_id] = LoRAReadError(errors[req.lora_slot], req.lora.lora_int_id)
                failed.add(req.lora.lora_int_id)
        return failed

    @staticmethod
    def _isolated(update: StepUpdate, req: Request, fn, *args) -> None:
        """fn(*args) for one request's part of the step; an exception marks the request failed."""
        if req.request_id in update.failed:
            return
        try:
            fn(*args)
        except Exception as e:   # noqa: BLE001 - the caller fails this request only
            update.failed[req.request_id] = e

    def _length_done(self, req: Request, seq: Sequence) -> bool:
        return seq.num_output_tokens >= req.max_tokens or \
            (self.max_model_len is not None and seq.num_tokens >= self.max_model_len)

    def _append_verified(self, s: ScheduledSeq, emitted: SamplerOutput) -> None:
        """A sequence's verified drafts: the accepted ones (their KV is computed) and the
        target's token after them, appended one by one with the usual stop checks (so nothing
        after a stop is kept). Blocks held only for rejected drafts' slots are released."""
        req, seq = s.request, s.seq
        accepted = len(emitted.token_ids) - 1
        self.stats.spec.record(len(s.draft_token_ids), accepted)
        req.spec.record(len(s.draft_token_ids), accepted)
        for row in range(len(emitted.token_ids)):
            self._append_token(req, seq, emitted, row)
            if seq.finished:
                return
            if row < accepted:
                seq.num_computed_tokens += 1
        if s.draft_start is not None:
            # The draft model was fed drafts 1 .. k-1 (it proposed draft j + 1 from draft j):
            # its KV holds the accepted ones but the last draft.
            self._draft_valid[seq.seq_id] = s.start + s.num_new_tokens + min(accepted, len(s.draft_token_ids) - 1)
        self.kv.trim(seq.seq_id, seq.num_tokens)

    def _append_token(self, req: Request, seq: Sequence, sample: SamplerOutput, row: int) -> None:
        p: SamplingParams = req.params
        token = sample.token_ids[row]
        seq.token_ids.append(token)
        if sample.logprobs is not None:
            seq.cumulative_logprob += sample.logprobs[row]
        if seq.logprobs is not None:
            # logprobs=0 asks for the sampled token's logprob only: no top-k lists come back.
            top_ids = sample.top_ids[row] if sample.top_ids is not None else []
            top_lps = sample.top_logprobs[row] if sample.top_logprobs is not None else []
            seq.logprobs.append(self._position_logprobs(token, sample.logprobs[row], sample.ranks[row],
                                                        top_ids, top_lps))
        # The grammar's matcher takes the token (it was sampled under the grammar's mask); where
        # the grammar ends, so does the sequence.
        grammar_ended = req.structured is not None and req.structured.accept(seq.seq_id, seq.output_token_ids)
        may_stop = seq.num_output_tokens >= p.min_tokens
        if may_stop and not p.ignore_eos and token in self.eos_token_ids:
            seq.finish_reason = "stop"
        elif may_stop and token in p.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif grammar_ended:
            seq.finish_reason = "stop"
        elif self._length_done(req, seq):
            seq.finish_reason = "length"
        if seq.finished:
            self.free_seq(seq, req)

    def _beam_step(self, req: Request, beams: list[Sequence], sample: SamplerOutput, rows: list[int]) -> None:
        """Replace the live beams by the best extensions: forking a beam shares its blocks,
        pruning one releases them. A candidate ending in any EOS id (unless ignore_eos)
        becomes a finished hypothesis, which holds no blocks."""
        p: BeamSearchParams = req.params
        chosen = select_candidates([b.cumulative_logprob for b in beams],
                                   [sample.top_ids[r] for r in rows], [sample.top_logprobs[r] for r in rows],
                                   p.beam_width)
        by_parent: dict[int, list] = {}
        for c in chosen:
            by_parent.setdefault(c.parent, []).append(c)
        new_beams: list[tuple[Sequence, object]] = []
        for b, parent in enumerate(beams):
            cands = by_parent.get(b, [])
            live = [c for c in cands if p.ignore_eos or c.token_id not in self.eos_token_ids]
            for c in cands:
                if c not in live:   # a finished hypothesis
                    hyp = req.fork_seq(parent, self.new_seq_id(), index=len(req.seqs))
                    hyp.token_ids.append(c.token_id)
                    hyp.cumulative_logprob = c.cum_logprob
                    hyp.finish_reason = "stop"
            if not live:
                req.seqs.remove(parent)        # pruned
                self.free_seq(parent, req)
                continue
            new_beams += [(self.fork_seq(req, parent), c) for c in live[1:]]
            new_beams.append((parent, live[0]))
        for seq, c in new_beams:
            seq.token_ids.append(c.token_id)
            seq.cumulative_logprob = c.cum_logprob
            if self._length_done(req, seq):
                seq.finish_reason = "length"
                self.free_seq(seq, req)

    def _position_logprobs(self, token: int, logprob: float, rank: int, top_ids, top_lps) -> dict[int, Logprob]:
        out = {token: Logprob(logprob, rank)}   # the token's text: the engine's output side
        for r, (t, lp) in enumerate(zip(top_ids, top_lps), start=1):
            if t not in out:
                out[t] = Logprob(lp, r)
        return out

    def _record_prompt_logprobs(self, out: SchedulerOutput, by_seq: dict[int, list[PromptTokenLogprob]]) -> None:
        for s in out.scheduled:
            scores = by_seq.get(s.seq.seq_id)
            req = s.request
            if scores is None or req.prompt_logprobs is None:
                continue
            for x in scores:
                pos = len(req.prompt_logprobs)
                req.prompt_logprobs.append(
                    self._position_logprobs(req.prompt_token_ids[pos], x.logprob, x.rank, x.top_ids, x.top_logprobs))

    # ---- accounting ------------------------------------------------------------------------
    def describe(self, max_listed: int = 16) -> str:
        """The queues with each request's sequences (computed / total tokens), and the free
        blocks: what to log when something is stuck."""
        def request(r: Request) -> str:
            seqs = " ".join(f"{s.num_computed_tokens}/{s.num_tokens}" for s in r.live_seqs)
            flags = "".join(f" {f}" for f in ("pending_fork", "rejoin") if getattr(r, f))
            return f"{r.request_id} [{seqs}]{flags}"
        parts = []
        for name, queue in (("running", self.running), ("swapped", self.swapped), ("waiting", self.waiting)):
            listed = [request(r) for r in list(queue)[:max_listed]]
            more = f", ... {len(queue) - max_listed} more" if len(queue) > max_listed else ""
            parts.append(f"{name} ({len(queue)}): {', '.join(listed) or '-'}{more}")
        parts.append(f"free blocks {self.kv.num_free_blocks}/{self.kv.num_blocks}")
        return "; ".join(parts)

    def memory_usage(self) -> MemoryUsage:
        """The KV cache's slots by what they hold now (kv/memory_usage.py). A sequence's final
        length is prompt + max_tokens; the first waiting request is the one free space must fit."""
        seqs = [(s.seq_id, s.num_computed_tokens, s.num_prompt_tokens + req.max_tokens)
                for req in self.running for s in req.live_seqs]
        head = self.waiting[0] if self.waiting else None
        return self.kv.memory_usage(seqs, None if head is None else len(head.prompt_token_ids) + head.max_tokens)
