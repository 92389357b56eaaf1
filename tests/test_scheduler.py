"""The scheduler on its own (no model): batching, chunked prefill, forks, preemption."""
import weakref
from collections import Counter

from hypothesis import example, given, settings
from hypothesis import strategies as st

import pytest

from pagedserve.batch import RunnerOutput
from pagedserve.config import EngineConfig
from pagedserve.invariants import check_paging_invariants
from pagedserve.request import Request, RequestStatus, Sequence
from pagedserve.sampling_params import SamplingParams
from pagedserve.scheduler import Scheduler, SchedulerOutput
from tests.conftest import examples


def make_scheduler(num_blocks=64, block_size=4, num_host_blocks=0, **kw):
    kw.setdefault("enable_prefix_caching", False)
    # A small token budget with the default max_num_seqs would be refused (EngineConfig).
    kw.setdefault("max_num_seqs", min(256, kw.get("max_num_batched_tokens", 2048)))
    return Scheduler(EngineConfig(block_size=block_size, **kw), num_blocks, num_host_blocks=num_host_blocks)


class ShadowWorker:
    """What the worker does with a SchedulerOutput, on a shadow of the KV memory that holds
    token ids instead of keys and values: swap out, swap in, block copies, then write each
    scheduled token into its slot. Then every scheduled sequence must read back, through
    its block table, exactly its own tokens up to the end of this step: the check that
    sharing, copy-on-write, prefix hits, preemption and swapping never lose or mix up KV."""

    def __init__(self, sched: Scheduler) -> None:
        B = sched.block_size
        self.device = {i: [None] * B for i in range(sched.kv.pool.num_blocks)}
        swap = sched.kv.swap     # contiguous baselines have no swap space
        self.host = {i: [None] * B for i in range(swap.num_blocks if swap else 0)}

    def run(self, out) -> None:
        for dev, host in out.swap_out:
            self.host[host] = list(self.device[dev])
        for host, dev in out.swap_in:
            self.device[dev] = list(self.host[host])
        for src, dst in out.block_copies:
            self.device[dst] = list(self.device[src])
        for s in out.scheduled:
            B = len(self.device[s.block_ids[0]])
            for pos in range(s.start, s.start + s.num_new_tokens):
                self.device[s.block_ids[pos // B]][pos % B] = s.seq.token_ids[pos]
        for s in out.scheduled:
            B = len(self.device[s.block_ids[0]])
            end = s.start + s.num_new_tokens
            assert [self.device[s.block_ids[p // B]][p % B] for p in range(end)] == s.seq.token_ids[:end], (
                f"sequence {s.seq.seq_id} reads wrong KV")


_workers: "weakref.WeakKeyDictionary[Scheduler, ShadowWorker]" = weakref.WeakKeyDictionary()


def add(sched, rid, prompt_len, max_tokens, best_of=1, prompt=None):
    prompt = prompt or [7] * prompt_len
    params = SamplingParams(max_tokens=max_tokens, n=best_of, temperature=1.0)
    req = Request.create(rid, None, prompt, params, max_tokens, sched.new_seq_id())
    sched.add_request(req)
    return req


def check_progress(out: SchedulerOutput, head: Request | None, had_work: bool) -> None:
    """The scheduler's liveness argument (scheduler.py), one step at a time: a step with
    work schedules tokens, and the oldest running request (head of `running` before the
    step) computes a token and is not preempted."""
    assert out.scheduled or not had_work, "no progress: nothing scheduled while requests wait"
    if head is not None:
        assert head not in out.preempted, f"the oldest running request {head.request_id} was preempted"
        assert any(s.request is head for s in out.scheduled), (
            f"the oldest running request {head.request_id} computed nothing")


def fake_step(sched):
    """A step with a "model" that always samples token 1, applied by the scheduler's own
    update_from_output (requests end at max_tokens). Checks progress too."""
    head, had_work = (sched.running[0] if sched.running else None), sched.num_unfinished > 0
    out = sched.schedule()
    check_paging_invariants(sched, out)
    check_progress(out, head, had_work)
    if sched not in _workers:
        _workers[sched] = ShadowWorker(sched)
    _workers[sched].run(out)
    ids = [s.seq.seq_id for s in out.sampled]
    assert not sched.update_from_output(out, RunnerOutput.of_tokens(ids, [1] * len(ids))).failed
    check_paging_invariants(sched)
    return out


def run_all(sched, max_steps=10_000):
    steps = 0
    while sched.num_unfinished:
        fake_step(sched)
        steps += 1
        assert steps < max_steps, "the scheduler made no progress"
    assert sched.kv.num_free_blocks == sched.kv.pool.num_blocks
    if sched.kv.swap is not None:
        assert sched.kv.swap.num_free_blocks == sched.kv.swap.num_blocks
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


def test_swap_preemption_moves_blocks_out_and_back_without_recomputing():
    sched = make_scheduler(num_blocks=6, block_size=4, num_host_blocks=8, max_num_batched_tokens=64,
                           preemption_mode="swap")
    old = add(sched, "old", 8, 8)
    new = add(sched, "new", 4, 8)
    swapped_out = swapped_in = 0
    saw_swapped = False
    while sched.num_unfinished:
        out = fake_step(sched)
        assert not (out.swap_out and out.swap_in)
        swapped_out += len(out.swap_out)
        swapped_in += len(out.swap_in)
        if out.swap_out:
            assert [r.request_id for r in out.preempted] == ["new"]
            assert new.status == RequestStatus.SWAPPED and sched.kv.num_held_blocks(new.seqs[0].seq_id) == 0
            saw_swapped = True
    assert saw_swapped and sched.stats.num_preemptions > 0
    assert sched.stats.num_recomputed_tokens == 0
    stats = sched.kv.stats().as_dict()
    assert stats["num_swapped_out_blocks"] == swapped_out == stats["num_swapped_in_blocks"] == swapped_in > 0
    assert old.seqs[0].num_output_tokens == 8 and new.seqs[0].num_output_tokens == 8


def test_a_group_is_swapped_as_a_whole_keeping_its_sharing():
    """A best_of=3 request forked over a shared prompt: swapped out, its shared blocks
    take one host block each, and it comes back shared."""
    sched = make_scheduler(num_blocks=64, block_size=4, num_host_blocks=64, max_num_batched_tokens=64,
                           preemption_mode="swap")
    req = add(sched, "g", 10, 6, best_of=3)
    fake_step(sched)
    fake_step(sched)                          # forked: 2 shared full blocks + 3 private partial ones
    ids = [s.seq_id for s in req.seqs]
    assert sched.kv.swap.num_blocks_to_swap(ids) == 2 + 3
    so = SchedulerOutput()
    sched._preempt(req, so)                   # by hand, as the scheduler does when blocks run out
    _workers[sched].run(so)
    assert len(so.swap_out) == 5 and sched.kv.swap.num_free_blocks == 64 - 5
    host = [sched.kv.swap.tables[i] for i in ids]
    assert host[0][:2] == host[1][:2] == host[2][:2]
    out = fake_step(sched)                    # swapped back in (and run) at the next step
    assert len(out.swap_in) == 5 and req.status == RequestStatus.RUNNING
    tables = [sched.kv.block_ids(i) for i in ids]
    assert tables[0][:2] == tables[1][:2] == tables[2][:2]
    run_all(sched)


def test_swap_space_exhaustion_falls_back_to_recompute():
    sched = make_scheduler(num_blocks=6, block_size=4, num_host_blocks=1, max_num_batched_tokens=64,
                           preemption_mode="swap")
    add(sched, "old", 8, 8)
    add(sched, "new", 4, 8)
    run_all(sched)
    assert sched.stats.num_preemptions > 0 and sched.stats.num_recomputed_tokens > 0
    assert sched.kv.stats().as_dict()["num_swapped_out_blocks"] == 0


def test_aborting_a_swapped_request_frees_its_host_blocks():
    sched = make_scheduler(num_blocks=6, block_size=4, num_host_blocks=8, max_num_batched_tokens=64,
                           preemption_mode="swap")
    add(sched, "old", 8, 8)
    new = add(sched, "new", 4, 8)
    while new.status != RequestStatus.SWAPPED:
        fake_step(sched)
    assert sched.kv.swap.num_free_blocks < 8
    sched.finish_request(new)
    assert sched.kv.swap.num_free_blocks == 8 and not sched.swapped
    run_all(sched)


def check_every_request_finishes(reqs, sched: Scheduler) -> None:
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


@pytest.mark.fuzz
@settings(max_examples=examples(60))
@given(reqs=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 12), st.sampled_from([1, 1, 2, 3])),
                     min_size=1, max_size=8),
       num_blocks=st.integers(8, 30), block_size=st.sampled_from([1, 2, 4]),
       budget=st.integers(4, 40), max_seqs=st.integers(3, 8), caching=st.booleans(),
       watermark=st.sampled_from([0.0, 0.01, 0.1, 0.3]))
# Issue 19: the n=3 request is preempted right after forking; re-admitting it takes its whole
# prompt from the prefix cache and rejoins its followers, then fails for want of blocks. The
# failed admission used to leave three sequences that no longer shared a prompt: too many
# blocks for the cache, so it waited forever.
@example(reqs=[(7, 12, 1), (15, 1, 3)], num_blocks=24, block_size=1, budget=33, max_seqs=4, caching=True,
         watermark=0.0)
def test_every_request_finishes_without_leaks(reqs, num_blocks, block_size, budget, max_seqs, caching, watermark):
    sched = Scheduler(EngineConfig(block_size=block_size, max_num_batched_tokens=max(budget, max_seqs),
                                   max_num_seqs=max_seqs,
                                   enable_prefix_caching=caching, admission_watermark=watermark), num_blocks)
    check_every_request_finishes(reqs, sched)


@pytest.mark.fuzz
@settings(max_examples=examples(60))
@given(reqs=st.lists(st.tuples(st.integers(1, 24), st.integers(4, 16), st.sampled_from([1, 1, 2, 3])),
                     min_size=2, max_size=8),
       num_blocks=st.integers(6, 16), block_size=st.sampled_from([1, 2, 4]),
       budget=st.integers(4, 40), max_seqs=st.integers(3, 8), caching=st.booleans(),
       num_host_blocks=st.integers(0, 24))
def test_swap_preemption_finishes_everything_without_leaks(reqs, num_blocks, block_size, budget, max_seqs,
                                                           caching, num_host_blocks):
    """Tight device memory and a swap space from none to plenty: groups are swapped out and
    back (or recomputed when swap space is short), the shadow worker checks every byte of
    KV comes back, and both pools end empty."""
    sched = Scheduler(EngineConfig(block_size=block_size, max_num_batched_tokens=max(budget, max_seqs),
                                   max_num_seqs=max_seqs,
                                   enable_prefix_caching=caching, preemption_mode="swap"), num_blocks,
                      num_host_blocks=num_host_blocks)
    check_every_request_finishes(reqs, sched)


@pytest.mark.fuzz
@settings(max_examples=examples(80))
@given(reqs=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 12), st.sampled_from([1, 1, 2, 3]),
                               st.integers(0, 12)), min_size=1, max_size=8),
       num_blocks=st.integers(8, 30), block_size=st.sampled_from([1, 2, 4]), budget=st.integers(4, 40),
       max_seqs=st.integers(3, 8), caching=st.booleans(), num_host_blocks=st.sampled_from([0, 0, 4, 16]),
       watermark=st.sampled_from([0.0, 0.01, 0.1, 0.3]), long=st.sampled_from([0, 0, 1, 3, 8]),
       max_long=st.integers(1, 2), max_partial=st.sampled_from([0, 0, 2]))
# Found by this test before the oldest request went first: newer requests' decodes took the
# blocks, and the oldest request, a chunked prefill, preempted itself (and the step ran nothing).
@example(reqs=[(1, 12, 1, 0), (7, 11, 2, 0), (25, 5, 2, 0)], num_blocks=25, block_size=2, budget=9, max_seqs=5,
         caching=True, num_host_blocks=0, watermark=0.0, long=0, max_long=1, max_partial=0)
@example(reqs=[(1, 5, 1, 0), (10, 4, 2, 0), (4, 2, 1, 0)], num_blocks=11, block_size=2, budget=13, max_seqs=3,
         caching=False, num_host_blocks=0, watermark=0.0, long=0, max_long=1, max_partial=0)
def test_the_oldest_request_advances_every_step(reqs, num_blocks, block_size, budget, max_seqs, caching,
                                                num_host_blocks, watermark, long, max_long, max_partial):
    """Liveness, over the fuzzer's space with requests arriving while others run (the last
    number is the step a request arrives at): every step with work schedules tokens, the
    oldest running request computes a token in every step and is never preempted
    (fake_step checks both), so it finishes within as many steps as it has tokens to
    compute: its prompt, its sequences' outputs if it rejoins, then one step per token."""
    sched = Scheduler(EngineConfig(block_size=block_size, max_num_batched_tokens=max(budget, max_seqs),
                                   max_num_seqs=max_seqs,
                                   enable_prefix_caching=caching,
                                   preemption_mode="swap" if num_host_blocks else "recompute",
                                   admission_watermark=watermark, long_prefill_token_threshold=long,
                                   max_long_partial_prefills=max_long, max_num_partial_prefills=max_partial),
                      num_blocks, num_host_blocks=num_host_blocks)
    arrivals = sorted(enumerate(reqs), key=lambda r: r[1][3])
    steps_as_head: Counter = Counter()
    step = 0
    while arrivals or sched.num_unfinished:
        while arrivals and arrivals[0][1][3] <= step:
            i, (p, m, n, _) = arrivals.pop(0)
            try:
                add(sched, str(i), p, m, best_of=n, prompt=[i % 2] * p)
            except ValueError:
                pass   # can never fit: refused up front
        head = sched.running[0] if sched.running else None
        fake_step(sched)
        if head is not None:
            steps_as_head[head.request_id] += 1
            bound = len(head.prompt_token_ids) + head.max_seqs * head.max_tokens + head.max_tokens
            assert steps_as_head[head.request_id] <= bound, f"request {head.request_id} is stuck at the head"
        step += 1
        assert step < 10_000, "the scheduler made no progress"
    assert sched.kv.num_free_blocks == sched.kv.pool.num_blocks


# ---- admission control (issue 18) ------------------------------------------------------------

def test_admission_keeps_a_watermark_of_free_blocks():
    """A new prompt waits while admitting it would leave fewer free blocks than the watermark
    (10% of 100 here), counting the blocks its whole prompt needs, not only the first chunk."""
    sched = make_scheduler(num_blocks=100, block_size=4, max_num_batched_tokens=16, admission_watermark=0.1)
    a = add(sched, "a", 4, 6)                 # 1 block, then 2-3 while decoding
    fake_step(sched)
    b = add(sched, "b", 4 * 88, 1)            # 88 blocks: 100 - 2 - 88 = 10 free is still allowed...
    c = add(sched, "c", 4, 1)
    fake_step(sched)
    assert b.status == RequestStatus.RUNNING  # ...though its first chunk takes only 4 of them
    out = fake_step(sched)
    assert c.status == RequestStatus.WAITING and not any(s.request is c for s in out.scheduled)
    run_all(sched)
    assert a.finished and b.finished and c.finished


def test_a_prompt_over_the_watermark_waits_until_blocks_free_up():
    sched = make_scheduler(num_blocks=100, block_size=4, max_num_batched_tokens=64, admission_watermark=0.1)
    a = add(sched, "a", 40, 3)                # 10 blocks (11 with its outputs)
    fake_step(sched)
    b = add(sched, "b", 4 * 81, 1)            # 81 blocks: 100 - 11 - 81 = 8 < 10
    while not a.finished:
        fake_step(sched)
        assert b.status == RequestStatus.WAITING or a.finished
    fake_step(sched)
    assert b.status in (RequestStatus.RUNNING, RequestStatus.FINISHED)
    run_all(sched)
    # Without the watermark it is admitted beside a at once.
    sched = make_scheduler(num_blocks=100, block_size=4, max_num_batched_tokens=64, admission_watermark=0.0)
    a = add(sched, "a", 40, 3)
    fake_step(sched)
    b = add(sched, "b", 4 * 81, 1)
    fake_step(sched)
    assert b.status == RequestStatus.RUNNING and not a.finished


def test_the_watermark_never_holds_back_a_request_when_nothing_runs():
    """Liveness (scheduler.py, point 4): alone, a request gets the whole pool."""
    sched = make_scheduler(num_blocks=100, block_size=4, max_num_batched_tokens=512, admission_watermark=0.5)
    req = add(sched, "big", 4 * 95, 4 * 4)
    fake_step(sched)
    assert req.status == RequestStatus.RUNNING
    run_all(sched)


def test_admission_watermark_is_validated():
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="admission_watermark"):
            EngineConfig(admission_watermark=bad)
