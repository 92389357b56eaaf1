"""The paging invariant checker catches each kind of corruption, and costs nothing when off."""
from __future__ import annotations

from collections import deque

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.config import EngineConfig
from pagedserve.invariants import check_paging_invariants
from pagedserve.request import Request, RequestStatus, Sequence
from pagedserve.scheduler import Scheduler, ScheduledSeq, SchedulerOutput


def scheduler_with_a_running_pair():
    """A request with two sequences sharing a 6-token prompt (block size 4), just forked."""
    sched = Scheduler(EngineConfig(block_size=4, max_num_batched_tokens=64, max_num_seqs=64), num_blocks=8)
    params = SamplingParams(n=2, temperature=1.0, max_tokens=4)
    req = Request.create("r", None, list(range(6)), params, 4, sched.new_seq_id())
    sched.add_request(req)
    sched.schedule()                               # 5 prompt tokens on the leader
    req.seqs[0].num_computed_tokens = 5
    check_paging_invariants(sched, request_ids=["r"])
    return sched, req


def test_a_consistent_state_passes():
    sched, req = scheduler_with_a_running_pair()
    out = sched.schedule()                         # fork; each writes position 5 into its own copy
    check_paging_invariants(sched, out, ["r"])
    assert len(req.seqs) == 2 and out.block_copies


@pytest.mark.parametrize("corrupt,message", [
    (lambda s, r: setattr(s.kv.tables[r.seqs[0].seq_id][0], "ref_cnt", 5), "ref_cnt"),
    (lambda s, r: s.kv.pool.free_queue.pop(next(iter(s.kv.pool.free_queue))), "free-queue"),
    (lambda s, r: s.kv.tables[r.seqs[0].seq_id].append(s.kv.pool.allocate(1)[0]), "blocks for"),
    (lambda s, r: setattr(r.seqs[0], "finish_reason", "stop"), "live"),
    (lambda s, r: s.running.remove(r), "disagree"),
    (lambda s, r: setattr(r, "status", RequestStatus.FINISHED), "status"),
    (lambda s, r: setattr(r.seqs[0], "num_computed_tokens", 40), "computed"),
    (lambda s, r: s.kv.keys[r.seqs[0].seq_id].__setitem__(0, (None, (9, 9, 9, 9))), "prefix"),
], ids=["ref-count", "free-queue", "over-allocated", "finished-seq-holds-blocks", "request-not-queued",
        "wrong-status", "computed-without-slots", "stale-prefix-key"])
def test_each_corruption_is_caught(corrupt, message):
    sched, req = scheduler_with_a_running_pair()
    corrupt(sched, req)
    with pytest.raises(AssertionError, match=message):
        check_paging_invariants(sched, request_ids=["r"])


def test_engine_and_scheduler_must_agree_on_requests():
    sched, _ = scheduler_with_a_running_pair()
    with pytest.raises(AssertionError, match="disagree"):
        check_paging_invariants(sched, request_ids=["r", "ghost"])


def test_a_write_into_a_shared_block_is_caught():
    sched, req = scheduler_with_a_running_pair()
    leader = req.seqs[0]
    child = sched.fork_seq(req, leader)            # shares both blocks, the partial one too
    out = SchedulerOutput()
    out.scheduled.append(ScheduledSeq.of(req, child, 1, sched.kv.block_ids(child.seq_id)))
    with pytest.raises(AssertionError, match="writes block"):
        check_paging_invariants(sched, out)        # no copy-on-write happened


def test_a_stale_block_table_in_the_step_is_caught():
    sched, req = scheduler_with_a_running_pair()
    out = sched.schedule()
    out.scheduled[0].block_ids = list(reversed(out.scheduled[0].block_ids))
    with pytest.raises(AssertionError, match="stale block table"):
        check_paging_invariants(sched, out)


def test_a_stale_block_table_in_the_workers_batch_is_caught():
    sched, req = scheduler_with_a_running_pair()
    out = sched.schedule()
    out.batch.seqs[0].block_ids = list(reversed(out.batch.seqs[0].block_ids))
    with pytest.raises(AssertionError, match="stale block table in the batch"):
        check_paging_invariants(sched, out)


def test_a_swapped_out_request_holding_device_blocks_is_caught():
    sched, req = scheduler_with_a_running_pair()
    sched.running.remove(req)                      # "swapped out", but its device table kept
    req.status = RequestStatus.SWAPPED
    sched.swapped = deque([req])
    with pytest.raises(AssertionError, match="device blocks|not live in a running request"):
        check_paging_invariants(sched, request_ids=["r"])


def test_the_engine_checks_every_step_only_when_asked(tiny_llama, monkeypatch):
    calls = []
    monkeypatch.setattr("pagedserve.engine.llm_engine.check_paging_invariants", lambda *a: calls.append(a))
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    monkeypatch.setenv("PAGEDSERVE_CHECK_INVARIANTS", "0")
    LLM(tiny_llama.path, dtype="float32", num_gpu_blocks_override=16).generate("one", params, use_tqdm=False)
    assert calls == []                             # off: never called
    LLM(tiny_llama.path, dtype="float32", num_gpu_blocks_override=16,
        check_invariants=True).generate("one", params, use_tqdm=False)
    assert len(calls) >= 2 * 3                     # after each schedule() and after each step


@pytest.mark.parametrize("params,message", [
    (dict(stop_token_ids=[10**7], min_tokens=1), "stop_token_ids"),
    (dict(logit_bias={10**7: 1.0}), "logit_bias"),
    (dict(top_k=10**30), "top_k"),
])
def test_token_ids_that_would_fail_a_step_are_refused_up_front(tiny_llama, params, message):
    llm = LLM(tiny_llama.path, dtype="float32", num_gpu_blocks_override=16)
    with pytest.raises(ValueError, match=message):
        llm.generate("one", SamplingParams(max_tokens=2, **params), use_tqdm=False)
    assert llm.kv_cache_stats()["num_used_blocks"] == 0
    assert llm.generate("one", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def test_a_failed_step_leaves_the_offline_llm_usable(tiny_llama, monkeypatch):
    llm = LLM(tiny_llama.path, dtype="float32", num_gpu_blocks_override=16)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    good = llm.generate("one", params, use_tqdm=False)[0].outputs[0].token_ids
    runner = llm.engine.runner
    monkeypatch.setattr(runner, "execute", lambda sched: (_ for _ in ()).throw(RuntimeError("device lost")))
    with pytest.raises(RuntimeError, match="device lost"):
        llm.generate(["one", "two"], params, use_tqdm=False)
    monkeypatch.undo()
    assert not llm.engine.has_unfinished_requests() and llm.kv_cache_stats()["num_used_blocks"] == 0
    assert llm.generate("one", params, use_tqdm=False)[0].outputs[0].token_ids == good
