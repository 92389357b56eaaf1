"""The paging invariants (docs/architecture.md, Invariants), checked in one place.

`check_paging_invariants(scheduler)` checks the whole paging state. Here, what
only the scheduler knows: its queues agree with the requests' states and the
engine's, and a waiting group will share its prompt again (its leader recomputes
it alone). Through the `KVCache` interface (`check_invariants`, `check_step`; each
allocator checks its own structures): the block pools and tables (ref counts equal
the tables holding each block, free queues hold exactly the unreferenced blocks,
the prefix-cache index agrees with the blocks), which sequences may hold blocks
(live sequences of running requests on the device, of swapped-out requests in swap
space, nobody else, so nothing is held once a request ends), that every computed
token has a slot, that each sequence's prefix-cache keys are those of its tokens
(and salt). Given the `SchedulerOutput` of the step about to run, it also checks
what that step writes: no block that another table holds, copy-on-write and
swap-in copies into blocks their sequences hold, block tables handed to the worker
up to date.

The engine calls it after `schedule()` and after every step when
`EngineConfig.check_invariants` or PAGEDSERVE_CHECK_INVARIANTS=1 is set (the
tests set it); otherwise nothing here runs. Failures raise AssertionError
naming the block, sequence or request at fault.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Collection
from typing import TYPE_CHECKING

from pagedserve.kv.block_pool import kv_salt
from pagedserve.kv.interface import SeqState, StepWrite
from pagedserve.request import RequestStatus

if TYPE_CHECKING:
    from pagedserve.scheduler import Scheduler, SchedulerOutput


def check_paging_invariants(scheduler: "Scheduler", out: "SchedulerOutput | None" = None,
                            request_ids: Collection[str] | None = None) -> None:
    """Raise AssertionError if the paging state is inconsistent.

    out: the output of the `schedule()` call just made (the step has not run yet).
    request_ids: the requests the engine still tracks; each must be queued, and
    nothing else may be.
    """
    kv = scheduler.kv
    _check_queues(scheduler, request_ids)
    drafts = {s.seq.seq_id: len(s.draft_token_ids) for s in out.scheduled} if out is not None else {}
    new = {s.seq.seq_id: s.num_new_tokens for s in out.scheduled} if out is not None else {}
    live = {s.seq_id: SeqState(s.token_ids, s.num_computed_tokens, kv_salt(r.cache_salt, r.lora_key),
                               drafts.get(s.seq_id, 0), new.get(s.seq_id, 0))
            for r in scheduler.running for s in r.live_seqs}
    swapped = {s.seq_id for r in scheduler.swapped for s in r.live_seqs}
    kv.check_invariants(live, swapped)
    if out is not None:
        kv.check_step(_check_step(out), out.block_copies, out.swap_out, out.swap_in)
        _check_batch(scheduler, out)


def _check_queues(scheduler: "Scheduler", request_ids: Collection[str] | None) -> None:
    queues = {"waiting": scheduler.waiting, "running": scheduler.running, "swapped": scheduler.swapped}
    seen = Counter(id(r) for q in queues.values() for r in q)
    assert all(c == 1 for c in seen.values()), "a request is queued twice"
    for name, queue in queues.items():
        for req in queue:
            assert req.status == RequestStatus[name.upper()], (
                f"request {req.request_id} is {name} with status {req.status}")
            assert name == "waiting" or req.live_seqs, f"{name} request {req.request_id} has no live sequence"
            if name == "waiting":
                # Waiting means computed from scratch on admission; a group's leader alone
                # recomputes the shared prompt (each sequence on its own could need more
                # blocks than the group was admitted for, and never fit).
                assert all(s.num_computed_tokens == 0 for s in req.live_seqs), (
                    f"waiting request {req.request_id} has computed tokens")
                assert len(req.live_seqs) <= 1 or req.rejoin, (
                    f"waiting request {req.request_id} has {len(req.live_seqs)} sequences that do not rejoin")
    if request_ids is not None:
        queued = {r.request_id for q in queues.values() for r in q}
        assert queued == set(request_ids), (
            f"engine and scheduler disagree: engine only {set(request_ids) - queued}, "
            f"scheduler only {queued - set(request_ids)}")


def _check_step(out: "SchedulerOutput") -> list[StepWrite]:
    """What the scheduler can check of the step about to run (each sequence once, running,
    computing tokens it has from its computed count); returns the step's writes for the KV
    cache to check against its block tables."""
    seen: set[int] = set()
    writes = []
    for s in out.scheduled:
        seq_id = s.seq.seq_id
        assert seq_id not in seen, f"sequence {seq_id} is scheduled twice in one step"
        seen.add(seq_id)
        assert s.request.status == RequestStatus.RUNNING, f"request {s.request.request_id} scheduled while " \
                                                          f"{s.request.status}"
        assert s.num_new_tokens > 0 and s.start == s.seq.num_computed_tokens
        assert s.start + s.num_new_tokens <= s.seq.num_tokens, f"sequence {seq_id} computes tokens it lacks"
        assert not s.draft_token_ids or (s.samples and s.num_new_tokens == 1), (
            f"sequence {seq_id} has drafts but does not decode")
        writes.append(StepWrite(seq_id, s.start, s.num_query_tokens, s.block_ids, s.group_block_ids))
    return writes


def _check_batch(scheduler: "Scheduler", out: "SchedulerOutput") -> None:
    """The worker's copy of the step (`out.batch`, plain data) says what the step does:
    the same sequences, tokens, current block tables, sampling rows, block moves, and a
    grammar bitmask row for each constrained sampling row."""
    batch = out.batch
    by_id = {s.seq.seq_id: s for s in out.scheduled}
    assert sorted(by_id) == sorted(t.seq_id for t in batch.seqs), "the batch names other sequences than the step"
    for t in batch.seqs:
        s = by_id[t.seq_id]
        assert t.start == s.start and t.token_ids == s.seq.token_ids[s.start:s.start + s.num_new_tokens], (
            f"sequence {t.seq_id}: the batch computes other tokens")
        assert t.block_ids == scheduler.kv.block_ids(t.seq_id) and \
            batch.group_block_ids.get(t.seq_id, []) == scheduler.kv.group_block_ids(t.seq_id), (
                f"sequence {t.seq_id}: stale block table in the batch")
        assert (t.sample is not None) == s.samples, f"sequence {t.seq_id}: the batch samples where the step does not"
        assert t.draft_token_ids == s.draft_token_ids, f"sequence {t.seq_id}: the batch has other drafts"
        end = t.start + len(t.token_ids)   # a draft model catches up on its own tokens, up to the target's
        assert not t.draft_input_ids or (t.draft_start <= t.start and t.draft_input_ids ==
                                         s.seq.token_ids[t.draft_start:end]), \
            f"sequence {t.seq_id}: the draft model computes other tokens"
    assert [s.seq.seq_id for s in out.sampled] == [t.seq_id for t in batch.seqs
                                                   if t.sample is not None and not t.draft_token_ids]
    assert [s.seq.seq_id for s in out.spec] == [t.seq_id for t in batch.seqs if t.draft_token_ids]
    assert (batch.swap_out, batch.swap_in, batch.block_copies) == (out.swap_out, out.swap_in, out.block_copies), \
        "the batch moves other blocks than the step"
    constrained = [row for row, s in enumerate(out.sampled) if s.request.structured is not None]
    assert batch.grammar_rows == constrained, "the batch masks other rows than the constrained ones"
    assert (batch.grammar_bitmask is None) == (not constrained) and \
        (batch.grammar_bitmask is None or batch.grammar_bitmask.shape[0] == len(constrained)), \
        "the batch's grammar bitmask does not have one row per constrained row"
