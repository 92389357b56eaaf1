"""The scheduler on its own (no model): batching, chunked prefill, forks, preemption."""
from hypothesis import given, settings
from hypothesis import strategies as st

import pytest

from pagedserve.config import EngineConfig
from pagedserve.request import Request, RequestStatus, Sequence
from pagedserve.sampling_params import SamplingParams
from pagedserve.scheduler import Scheduler


def make_scheduler(num_blocks=64, block_size=4, **kw):
    kw.setdefault("enable_prefix_caching", False)
    return Scheduler(EngineConfig(block_size=block_size, **kw), num_blocks)


def add(sched, rid, prompt_len, max_tokens, best_of=1, prompt=None):
    prompt = prompt or [7] * prompt_len
    params = SamplingParams(max_tokens=max_tokens, n=best_of, temperature=1.0)
    req = Request(rid, None, prompt, params, max_tokens)
    req.seqs.append(Sequence(sched.new_seq_id(), 0, list(prompt), len(prompt)))
    req.pending_fork = best_of > 1
    sched.add_request(req)
    return req


def fake_step(sched):
    """What the engine does after the model runs: advance counts, append a token to each
    sequence that sampled, finish requests that reached max_tokens."""
    out = sched.schedule()
    sampled = []
    for s in out.scheduled:
        s.seq.num_computed_tokens += s.num_new_tokens
        if s.samples:
            s.seq.token_ids.append(1)
            sampled.append(s)
    done = set()
    for s in sampled:
        if s.seq.num_output_tokens >= s.request.max_tokens:
            s.seq.finish_reason = "length"
            sched.free_seq(s.seq)
            if not s.request.live_seqs:
                done.add(s.request)
    for req in done:
        sched.finish_request(req)
    sched.kv.check_invariants()
    return out


def run_all(sched, max_steps=10_000):
    steps = 0
    while sched.num_unfinished:
        fake_step(sched)
        steps += 1
        assert steps < max_steps, "the scheduler made no progress"
    assert sched.kv.num_free_blocks == sched.kv.pool.num_blocks
    return steps


def test_long_prompt_is_chunked_and_decodes_go_first():
    sched = make_scheduler(max_num_batched_tokens=8, max_num_seqs=8)
    a = add(sched, "a", 3, 5)
    out = fake_step(sched)                  # a: whole prompt, samples
    assert [(s.request.request_id, s.num_new_tokens, s.samples) for s in out.scheduled] == [("a", 3, True)]
    b = add(sched, "b", 20, 2)
    out = fake_step(sched)                  # a decodes first; b takes the rest of the budget
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 7)]
    assert not out.scheduled[1].samples
    out = fake_step(sched)
    assert [(s.request.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 7)]
    out = fake_step(sched)                  # b's last 6 prompt tokens, then it samples
    assert [(s.request.request_id, s.num_new_tokens, s.samples) for s in out.scheduled] == [
        ("a", 1, True), ("b", 6, True)]
    assert b.seqs[0].num_output_tokens == 1
    run_all(sched)


def test_requests_join_next_step_and_leave_when_done():
    sched = make_scheduler(max_num_batched_tokens=64)
    add(sched, "a", 4, 1)
    add(sched, "b", 4, 3)
    out = fake_step(sched)
    assert len(out.scheduled) == 2
    assert [r.request_id for r in sched.running] == ["b"]     # a finished after one token
    add(sched, "c", 4, 1)
    out = fake_step(sched)
    assert {s.request.request_id for s in out.scheduled} == {"b", "c"}


def test_max_num_seqs_limits_the_batch():
    sched = make_scheduler(max_num_seqs=2, max_num_batched_tokens=64)
    for i in range(5):
        add(sched, str(i), 2, 3)
    out = fake_step(sched)
    assert len(out.scheduled) == 2 and len(sched.waiting) == 3
    run_all(sched)


def test_blocks_are_allocated_on_demand_while_decoding():
    sched = make_scheduler(block_size=4)
    req = add(sched, "a", 4, 9)
    fake_step(sched)
    seq_id = req.seqs[0].seq_id
    held = [sched.kv.num_held_blocks(seq_id)]
    while not req.finished:
        fake_step(sched)
        if not req.finished:
            held.append(sched.kv.num_held_blocks(seq_id))
    # Token counts 5..12 are computed one by one: a block opens at 5 and at 9.
    assert held == [1, 2, 2, 2, 2, 3, 3, 3, 3][:len(held)]


def test_preemption_frees_the_newest_request_and_it_comes_back():
    sched = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64)
    old = add(sched, "old", 8, 8)            # grows to 16 tokens: 4 blocks
    new = add(sched, "new", 4, 8)            # grows to 12 tokens: 3 blocks
    fake_step(sched)
    preempted = []
    while sched.num_unfinished:
        out = fake_step(sched)
        preempted += [r.request_id for r in out.preempted]
    assert preempted and set(preempted) == {"new"}
    assert new.num_preemptions >= 1 and old.num_preemptions == 0
    assert sched.stats.num_preemptions == len(preempted)
    assert old.seqs[0].num_output_tokens == 8 and new.seqs[0].num_output_tokens == 8


def test_a_request_that_can_never_fit_is_refused():
    sched = make_scheduler(num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="can never fit in the KV cache.*needs 5 blocks.*has 4"):
        add(sched, "big", 10, 10)
    assert not sched.waiting


def test_parallel_sampling_forks_before_the_last_prompt_token():
    sched = make_scheduler(block_size=4, max_num_batched_tokens=64)
    req = add(sched, "p", 6, 3, best_of=3)
    out = fake_step(sched)
    # One sequence computes 5 prompt tokens; nothing is sampled yet.
    assert [(s.num_new_tokens, s.samples) for s in out.scheduled] == [(5, False)]
    out = fake_step(sched)
    # Forked: three sequences compute the last prompt token, each into its own copy of
    # the shared partial block (the last writer keeps the original).
    assert len(req.seqs) == 3
    assert [(s.num_new_tokens, s.samples) for s in out.scheduled] == [(1, True)] * 3
    assert len(out.block_copies) == 2
    tables = [sched.kv.block_ids(s.seq_id) for s in req.seqs]
    assert tables[0][0] == tables[1][0] == tables[2][0]              # full block shared
    assert len({t[1] for t in tables}) == 3                          # partial block private
    run_all(sched)


@settings(max_examples=60, deadline=None)
@given(reqs=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 12), st.sampled_from([1, 1, 2, 3])),
                     min_size=1, max_size=8),
       num_blocks=st.integers(8, 30), block_size=st.sampled_from([1, 2, 4]),
       budget=st.integers(4, 40), max_seqs=st.integers(3, 8), caching=st.booleans())
def test_every_request_finishes_without_leaks(reqs, num_blocks, block_size, budget, max_seqs, caching):
    sched = Scheduler(EngineConfig(block_size=block_size, max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                                   enable_prefix_caching=caching), num_blocks)
    added = []
    for i, (p, m, n) in enumerate(reqs):
        try:
            added.append(add(sched, str(i), p, m, best_of=n, prompt=[i % 2] * p))
        except ValueError:
            continue   # can never fit: refused up front
    run_all(sched)
    for req in added:
        assert req.status == RequestStatus.FINISHED
        assert all(s.num_output_tokens == req.max_tokens for s in req.seqs)
        assert len(req.seqs) == req.params.best_of
