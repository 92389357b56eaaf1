"""Stateful fuzzing of the scheduler and the KV cache manager together (no model).

A hypothesis state machine plays the engine: it adds requests (one sequence,
parallel sampling with n/best_of > 1, or beam-search-like forking and pruning;
prompts drawn from a few shared prefixes so the prefix cache hits), runs steps,
aborts, and forces preemptions, over tiny block pools and token budgets so that
running out of blocks is the common case. Preemption recomputes, or, once the
scheduler has swap mode (Scheduler(..., num_host_blocks=...)), swaps to a tiny host
pool in half the examples. A shadow of the KV memory records the token each
slot holds: swaps and copy-on-write copies first, then each scheduled token's
write, exactly as the worker does, after which every scheduled sequence must
read back its own tokens through its block table. With a draft model (speculative method
draft_model), a second shadow holds the draft's KV in the same blocks: before the draft catches
up from `draft_start`, every earlier position must hold the sequence's token. The "model" then returns random
tokens and, for beams, random ranked candidates, and the scheduler's own
`update_from_output` appends them, stops sequences, forks and prunes beams (the
engine's code path, not a copy of it). `check_paging_invariants`
runs after `schedule()` (what the step writes) and after every rule; at the end
every request is run to completion and no block may stay referenced.

CI runs 300 derandomized examples; the fuzz run (docs/testing.md) runs thousands:
    PAGEDSERVE_FUZZ_EXAMPLES=10000 .venv/bin/python -m pytest -m fuzz -q
"""
from __future__ import annotations

import inspect
import random

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedserve.batch import RunnerOutput, SamplerOutput
from pagedserve.config import EngineConfig
from pagedserve.invariants import check_paging_invariants
from pagedserve.request import Request, RequestStatus, Sequence
from pagedserve.sampling_params import BeamSearchParams, SamplingParams
from pagedserve.scheduler import Scheduler, SchedulerOutput
from tests.conftest import examples
from tests.test_scheduler import check_progress

pytestmark = pytest.mark.fuzz
MAX_EXAMPLES = examples(300)
EOS = 9
VOCAB = [0, 1, 2, 3]      # few tokens: generated text repeats, so it hits the prefix cache too
PREFIXES = [[0, 1, 2, 3, 0, 1, 2, 3, 0, 1], [1, 1, 1, 1, 2, 2, 2, 2], [3, 2, 1, 0, 3, 2]]
# Swap preemption is fuzzed as soon as the scheduler has it (it is being added on another branch).
HAS_SWAP = "num_host_blocks" in inspect.signature(Scheduler).parameters


class PagingMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(3, 32), block_size=st.sampled_from([1, 2, 4, 4]),
                budget=st.integers(1, 24), max_seqs=st.sampled_from([1, 2, 3, 4, 6, 8]), caching=st.booleans(),
                partial=st.booleans(), long=st.sampled_from([0, 0, 2, 5]), spec_k=st.sampled_from([0, 0, 1, 3]), method=st.sampled_from(["ngram", "suffix", "draft_model"]),
                **({"num_host_blocks": st.sampled_from([0, 0, 4, 16])} if HAS_SWAP else {}))
    def setup(self, num_blocks, block_size, budget, max_seqs, caching, partial, long, spec_k, method,
              num_host_blocks=0):
        # spec_k > 0: n-gram or suffix drafts (the tiny vocabulary repeats, so they come often),
        # or a draft model's (random tokens, its KV in a second shadow), verified by
        # _model_output with a random number accepted.
        # (A draft model's drafts go off above 2 running requests: its KV then lags and catches up.)
        spec = {"method": method, "num_speculative_tokens": spec_k,
                "disable_by_batch_size": 2 if method == "draft_model" else 8,
                **({"model": "fuzz-draft"} if method == "draft_model" else
                   {"prompt_lookup_min": 1, "prompt_lookup_max": 2})} if spec_k else None
        config = EngineConfig(block_size=block_size, max_num_batched_tokens=max(budget, max_seqs),
                              max_num_seqs=max_seqs,
                              enable_prefix_caching=caching, enable_partial_block_caching=partial,
                              long_prefill_token_threshold=long,
                              speculative_config=spec,
                              preemption_mode="swap" if num_host_blocks else "recompute")
        self.sched = Scheduler(config, num_blocks, num_host_blocks=num_host_blocks, eos_token_ids={EOS})
        self.host: dict[int, list] = {i: [None] * block_size for i in range(num_host_blocks)}
        self.requests: dict[str, Request] = {}   # unfinished, as the engine keeps them
        self.done: list[Request] = []
        self.aborted: set[str] = set()
        self.content: dict[int, list] = {i: [None] * block_size for i in range(num_blocks)}
        # The draft model's KV in the same blocks (method draft_model), and its proposals this step.
        self.draft_host: dict[int, list] = {i: [None] * block_size for i in range(num_host_blocks)}
        self.draft_content: dict[int, list] = {i: [None] * block_size for i in range(num_blocks)}
        self.proposals: dict[int, list[int]] = {}
        self.counter = 0
        self.stats = dict.fromkeys(_TOTALS, 0)
        del self.stats["examples"], self.stats["requests"]

    # ---- requests in -----------------------------------------------------------------------
    @rule(prefix=st.integers(0, len(PREFIXES) - 1), cut=st.integers(0, 10),
          suffix=st.lists(st.sampled_from(VOCAB), max_size=8), max_tokens=st.integers(1, 8),
          kind=st.sampled_from(["single", "single", "parallel", "beam"]), n=st.integers(1, 3),
          extra=st.integers(0, 2), prompt_logprobs=st.booleans())
    def add_request(self, prefix, cut, suffix, max_tokens, kind, n, extra, prompt_logprobs):
        self._add(PREFIXES[prefix][:cut] + suffix or [0], max_tokens, kind, n, extra, prompt_logprobs)

    @precondition(lambda self: self.done)
    @rule(which=st.integers(0, 1000), suffix=st.lists(st.sampled_from(VOCAB), min_size=1, max_size=4),
          max_tokens=st.integers(1, 8))
    def continue_a_finished_request(self, which, suffix, max_tokens):
        """A chat's next turn: a finished sequence's tokens (prompt and output) and new ones (its
        last, partly computed block may be cached: enable_partial_block_caching)."""
        seq = self.done[which % len(self.done)].seqs[0]
        self._add(seq.token_ids + suffix, max_tokens, "single", 1, 0, False)

    def _add(self, prompt, max_tokens, kind, n, extra, prompt_logprobs):
        self.counter += 1
        rid = f"r{self.counter}"
        if kind == "beam":
            params = BeamSearchParams(beam_width=n + extra, max_tokens=max_tokens)
        else:
            best_of = n + extra if kind == "parallel" else 1
            params = SamplingParams(n=n if kind == "parallel" else 1, best_of=best_of, temperature=1.0,
                                    max_tokens=max_tokens,
                                    prompt_logprobs=0 if prompt_logprobs else None)   # no prefix-cache hits
        req = Request.create(rid, None, prompt, params, max_tokens, self.sched.new_seq_id())
        free = self.sched.kv.num_free_blocks
        try:
            self.sched.add_request(req)
        except ValueError as e:
            assert "never fit" in str(e) or "max_num_seqs" in str(e), e
            assert self.sched.kv.num_free_blocks == free and req not in self.sched.waiting
            self.stats["refused"] += 1
            self.stats["refused_seqs" if "max_num_seqs" in str(e) else "refused_blocks"] += 1
            return
        self.requests[rid] = req

    # ---- one engine step -------------------------------------------------------------------
    @rule(seed=st.integers(0, 2**16))
    def step(self, seed):
        self._step(random.Random(seed))

    def _step(self, rng: random.Random) -> None:
        sched = self.sched
        head, had_work = (sched.running[0] if sched.running else None), sched.num_unfinished > 0
        out = sched.schedule()
        self.stats["steps"] += 1
        self.stats["preemptions"] += len(out.preempted)
        self.stats["copies"] += len(out.block_copies)
        check_paging_invariants(sched, out, self.requests)
        check_progress(out, head, had_work)
        self._run_on_shadow_memory(out)

        sampled: dict[str, list[Sequence]] = {}
        for s in out.sampled + out.spec:   # with drafts or without
            sampled.setdefault(s.request.request_id, []).append(s.seq)
        for rid, seqs in sampled.items():
            req = self.requests[rid]
            if len(req.live_seqs) > 1 or len(seqs) > 1:
                # Sequences of one request advance in lock step: all sample together.
                assert {s.seq_id for s in seqs} == {s.seq_id for s in req.live_seqs}, f"{rid} out of lock step"
        update = sched.update_from_output(out, self._model_output(out, rng, self.proposals))
        assert not update.failed, update.failed
        for rid in update.finished:
            self._retire(self.requests[rid])

    @staticmethod
    def _model_output(out: SchedulerOutput, rng: random.Random, proposals: dict[int, list[int]]) -> RunnerOutput:
        """Random tokens (EOS one time in ten) and, per row, a random ranked top list of
        distinct tokens, as many as a beam asks for (beams pick among them)."""
        tokens, logprobs, top_ids, top_lps = [], [], [], []
        for s in out.sampled:
            tokens.append(EOS if rng.random() < 0.1 else rng.choice(VOCAB))
            logprobs.append(-rng.random())
            k = s.request.params.beam_width if s.request.is_beam_search else 1
            top_ids.append(rng.sample(VOCAB + [EOS], k))
            top_lps.append(sorted((-3 * rng.random() for _ in range(k)), reverse=True))
        sample = SamplerOutput(tokens, logprobs, top_ids, top_lps, [1] * len(tokens)) if tokens else None
        spec = {}
        for s in out.spec:   # a random number of drafts accepted, then a token that is not the next draft
            drafts = proposals.get(s.seq.seq_id, s.draft_token_ids)
            a = rng.randint(0, len(drafts))
            last = rng.choice([t for t in VOCAB + [EOS] if a == len(drafts) or t != drafts[a]])
            emitted = drafts[:a] + [last]
            spec[s.seq.seq_id] = SamplerOutput(emitted, [-rng.random() for _ in emitted], None, None,
                                               [1] * len(emitted))
        return RunnerOutput([s.seq.seq_id for s in out.sampled], sample, {}, spec=spec)

    def _run_on_shadow_memory(self, out) -> None:
        """The worker's view: swaps, copies, then writes; then each sequence reads its tokens back."""
        B = self.sched.block_size
        for content, host in ((self.content, self.host), (self.draft_content, self.draft_host)):
            for dev, h in getattr(out, "swap_out", ()):
                host[h] = list(content[dev])
            for h, dev in getattr(out, "swap_in", ()):
                content[dev] = list(host[h])
            saved = {dst: list(content[src]) for src, dst in out.block_copies}   # all read, then written
            content.update(saved)
        self.proposals = {}
        for t in out.batch.seqs:   # the draft model: it reads its own KV, catches up, proposes
            if not t.draft_input_ids:
                continue
            seen = [self.draft_content[t.block_ids[p // B]][p % B] for p in range(t.draft_start)]
            seq = next(s.seq for s in out.scheduled if s.seq.seq_id == t.seq_id)
            assert seen == seq.token_ids[:t.draft_start], f"sequence {t.seq_id}: the draft model reads wrong KV"
            proposed = [rng_token(t.seq_id, j) for j in range(len(t.draft_token_ids))]
            written = t.draft_input_ids + proposed[:-1]
            for i, tok in enumerate(written):
                pos = t.draft_start + i
                self.draft_content[t.block_ids[pos // B]][pos % B] = tok
            if proposed:
                self.proposals[t.seq_id] = proposed
        for s in out.scheduled:
            drafts = self.proposals.get(s.seq.seq_id, s.draft_token_ids)
            tokens = s.seq.token_ids[:s.start + s.num_new_tokens] + drafts
            for pos in range(s.start, len(tokens)):
                self.content[s.block_ids[pos // B]][pos % B] = tokens[pos]
            self.stats["drafts"] += len(s.draft_token_ids)
        for s in out.scheduled:
            end = s.start + s.num_new_tokens
            seen = [self.content[s.block_ids[p // B]][p % B] for p in range(end)]
            assert seen == s.seq.token_ids[:end], f"sequence {s.seq.seq_id} reads wrong KV through its blocks"

    def _retire(self, req: Request) -> None:
        del self.requests[req.request_id]
        self.done.append(req)

    # ---- faults ----------------------------------------------------------------------------
    @precondition(lambda self: self.requests)
    @rule(pick=st.integers(0, 10**6))
    def abort(self, pick):
        req = list(self.requests.values())[pick % len(self.requests)]
        for seq in req.live_seqs:
            seq.finish_reason = "abort"
        self.sched.finish_request(req)
        self.aborted.add(req.request_id)
        self._retire(req)

    @precondition(lambda self: self.sched.running)
    @rule(pick=st.integers(0, 10**6))
    def preempt(self, pick):
        """Memory pressure chosen by the fuzzer: preempt any running request between steps."""
        req = self.sched.running[pick % len(self.sched.running)]
        if HAS_SWAP:
            out = SchedulerOutput()
            self.sched._preempt(req, out)
            self._run_on_shadow_memory(out)     # a swap-out copies before the next step
        else:
            self.sched._preempt(req)
        assert (req.status == RequestStatus.WAITING and self.sched.waiting[0] is req) or \
            (req.status == RequestStatus.SWAPPED and req in self.sched.swapped)
        self.stats["preemptions"] += 1

    @invariant()
    def paging_state_is_consistent(self):
        check_paging_invariants(self.sched, request_ids=self.requests)

    def teardown(self):
        """Every request still queued runs to its end; then no block is referenced."""
        if not hasattr(self, "sched"):
            return
        rng = random.Random(0)
        for _ in range(5000):
            if not self.sched.num_unfinished:
                break
            self._step(rng)
            check_paging_invariants(self.sched, request_ids=self.requests)
        assert not self.sched.num_unfinished, "requests never finished"
        kv = self.sched.kv
        assert kv.num_free_blocks == kv.pool.num_blocks and not kv.tables, "blocks leaked"
        assert kv.swap is None or kv.swap.num_free_blocks == kv.swap.num_blocks, "host blocks leaked"
        for req in self.done:
            assert req.status == RequestStatus.FINISHED and not req.live_seqs
            if req.request_id in self.aborted:
                continue
            for seq in req.seqs:
                assert seq.num_output_tokens <= req.max_tokens
                assert seq.finish_reason == "stop" or seq.num_output_tokens == req.max_tokens, seq
            if not req.is_beam_search:
                assert len(req.seqs) == req.params.best_of
        _TOTALS["examples"] += 1
        for k, v in self.stats.items():
            _TOTALS[k] += v
        _TOTALS["requests"] += len(self.done)


def rng_token(seq_id: int, j: int) -> int:
    """A draft model's proposal: some token of the tiny vocabulary, fixed per (sequence, position)
    within a step so drafts repeat and are often accepted."""
    return VOCAB[(seq_id * 7 + j * 3) % len(VOCAB)]


_TOTALS = {"examples": 0, "requests": 0, "steps": 0, "preemptions": 0, "copies": 0, "refused": 0,
           "refused_seqs": 0, "refused_blocks": 0, "drafts": 0}

PagingMachine.TestCase.settings = settings(max_examples=MAX_EXAMPLES, stateful_step_count=40, deadline=None,
                                           suppress_health_check=[HealthCheck.too_slow])
TestPagingMachine = PagingMachine.TestCase


def test_fuzzing_exercised_the_hard_paths():
    """The fuzz run above (same session) really reached preemption, copy-on-write and refusals."""
    if _TOTALS["examples"] < 50:
        import pytest
        pytest.skip("run together with TestPagingMachine")
    print(f"\nfuzz totals: {_TOTALS}")
    assert _TOTALS["preemptions"] > 0 and _TOTALS["copies"] > 0 and _TOTALS["refused"] > 0 and _TOTALS["drafts"] > 0
