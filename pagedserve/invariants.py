"""The paging invariants of DESIGN.md, checked in one place.

`check_paging_invariants(scheduler)` checks the whole paging state: the block
pools and block tables (`KVCacheManager.check_invariants`: ref counts equal the
tables holding each block, free queues hold exactly the unreferenced blocks;
plus, here, the prefix-cache index against the blocks and tables), and what
only the scheduler knows: which requests may hold blocks (live sequences of
running requests on the device, of swapped-out requests in swap space, nobody
else, so nothing is held once a request ends), that a waiting group will share
its prompt again (its leader recomputes it alone), that every computed token has a
slot, that each sequence's prefix-cache keys are those of its tokens (and salt). Given the
`SchedulerOutput` of the step about to run, it also checks what that step
writes: no block that another table holds, copy-on-write and swap-in copies
into blocks their sequences hold, block tables handed to the worker up to date.

The engine calls it after `schedule()` and after every step when
`EngineConfig.check_invariants` or PAGEDSERVE_CHECK_INVARIANTS=1 is set (the
tests set it); otherwise nothing here runs. Failures raise AssertionError
naming the block, sequence or request at fault.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Collection
from typing import TYPE_CHECKING

from pagedserve.kv.block_pool import prefix_block_keys
from pagedserve.kv.kv_cache_manager import KVCacheManager, cdiv
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
    scheduler.kv.check_invariants()
    _check_queues(scheduler, request_ids)
    if not isinstance(scheduler.kv, KVCacheManager):
        return   # a contiguous-reservation baseline (kv/contiguous.py) checks its own regions
    _check_prefix_index(scheduler.kv)
    _check_tables(scheduler)
    _check_swapped(scheduler)
    if out is not None:
        _check_step(scheduler, out)
        _check_batch(scheduler, out)


def _swapped(scheduler: "Scheduler") -> list:
    """Requests preempted to swap space (preemption_mode="swap"); none without swapping."""
    return list(getattr(scheduler, "swapped", ()))


def _host_tables(kv) -> dict:
    return getattr(kv, "host_tables", {})


def _check_prefix_index(kv) -> None:
    """The prefix-cache index and the blocks agree, and each table's keys match its blocks."""
    pool = kv.pool
    assert all(pool.blocks[i] is b for i, b in pool.free_queue.items()), "free queue entry under a wrong id"
    for block in pool.blocks:
        assert block.key is None or pool.cached.get(block.key) is block, (
            f"block {block.block_id} has a prefix key but the cache index does not point at it")
    assert kv.enable_caching or not pool.cached, "blocks cached with prefix caching off"
    for seq_id, keys in kv.keys.items():
        table = kv.tables.get(seq_id) or _host_tables(kv).get(seq_id, [])
        assert len(keys) <= len(table), f"sequence {seq_id}: more prefix keys than blocks"
        for block, key in zip(table, keys):
            assert block.key in (None, key), f"sequence {seq_id}: block {block.block_id} is cached under another prefix"


def _check_queues(scheduler: "Scheduler", request_ids: Collection[str] | None) -> None:
    queues = {"waiting": scheduler.waiting, "running": scheduler.running, "swapped": _swapped(scheduler)}
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


def _check_tables(scheduler: "Scheduler") -> None:
    """Only live sequences of running requests hold blocks (so a finished, aborted or
    recompute-preempted request holds none); computed tokens have slots; prefix-cache
    keys are those of the sequence's tokens and its request's cache salt."""
    kv, B = scheduler.kv, scheduler.block_size
    live = {s.seq_id: s for r in scheduler.running for s in r.live_seqs}
    salts = {s.seq_id: r.cache_salt for r in scheduler.running for s in r.live_seqs}
    stray = set(kv.tables) - set(live)
    assert not stray, f"sequences {sorted(stray)} hold blocks but are not live in a running request"
    for seq_id, seq in live.items():
        table = kv.tables.get(seq_id, ())
        assert cdiv(seq.num_computed_tokens, B) <= len(table) <= cdiv(seq.num_tokens, B), (
            f"sequence {seq_id}: {len(table)} blocks for {seq.num_computed_tokens} computed of "
            f"{seq.num_tokens} tokens")
        keys = kv.keys.get(seq_id, [])
        assert seq_id not in kv.salts or kv.salts[seq_id] == salts[seq_id], (
            f"sequence {seq_id}: its cache salt is not its request's")
        expected = prefix_block_keys(seq.token_ids, B, len(keys), salts[seq_id])
        for i, (key, want) in enumerate(zip(keys, expected)):
            assert key == want, f"sequence {seq_id}: prefix-cache key of block {i} is not its tokens' and salt's"


def _check_swapped(scheduler: "Scheduler") -> None:
    """Swap space: only live sequences of swapped-out requests hold host blocks, and those
    hold no device blocks (the host pool itself is checked with the device pool)."""
    kv = scheduler.kv
    live = {s.seq_id for r in _swapped(scheduler) for s in r.live_seqs}
    stray = set(_host_tables(kv)) - live
    assert not stray, f"sequences {sorted(stray)} hold host blocks but are not live in a swapped request"
    on_device = live & set(kv.tables)
    assert not on_device, f"swapped-out sequences {sorted(on_device)} still hold device blocks"


def _check_step(scheduler: "Scheduler", out: "SchedulerOutput") -> None:
    """The step about to run writes only blocks its sequence alone holds.

    One exception is safe and expected: a block registered in the prefix cache while this
    step fills it (by its writes, after a copy-on-write copy) may be picked up by a request
    admitted later in the same step.
    Every holder then expects exactly the tokens being written (they share the block's
    key), and each layer writes the whole batch's keys and values before attending.
    """
    kv, B = scheduler.kv, scheduler.block_size
    seen: set[int] = set()
    written: set[int] = set()
    for s in out.scheduled:
        seq_id = s.seq.seq_id
        assert seq_id not in seen, f"sequence {seq_id} is scheduled twice in one step"
        seen.add(seq_id)
        assert s.request.status == RequestStatus.RUNNING, f"request {s.request.request_id} scheduled while " \
                                                          f"{s.request.status}"
        assert s.num_new_tokens > 0 and s.start == s.seq.num_computed_tokens
        assert s.start + s.num_new_tokens <= s.seq.num_tokens, f"sequence {seq_id} computes tokens it lacks"
        table = kv.tables.get(seq_id, [])
        assert s.block_ids == [b.block_id for b in table], f"sequence {seq_id}: stale block table in the step"
        assert len(table) >= cdiv(s.start + s.num_new_tokens, B), f"sequence {seq_id}: no slot for its tokens"
        for i in range(s.start // B, (s.start + s.num_new_tokens - 1) // B + 1):
            block = table[i]
            written.add(block.block_id)
            if block.ref_cnt > 1:
                holders = [sid for sid, t in kv.tables.items() if i < len(t) and t[i] is block]
                assert block.key is not None and len(holders) == block.ref_cnt and all(
                    i < len(kv.keys[h]) and kv.keys[h][i] == block.key for h in holders), (
                    f"sequence {seq_id} writes block {block.block_id} (logical {i}), which "
                    f"{block.ref_cnt} tables hold")
    dsts = [dst for _, dst in out.block_copies]
    assert len(set(dsts)) == len(dsts), "two copies into one block"
    for src, dst in out.block_copies:   # (whether dst may be shared was checked with the writes)
        assert src != dst and dst in written, f"copy-on-write {src} -> {dst}: the copy is not written this step"
    # Swaps run before the copies: each lands in a distinct block that a table holds.
    for name, pool in (("swap_out", getattr(kv, "host_pool", None)), ("swap_in", kv.pool)):
        dsts = [dst for _, dst in getattr(out, name, ())]
        assert len(set(dsts)) == len(dsts), f"{name}: two blocks moved into one"
        assert all(pool.blocks[d].ref_cnt > 0 for d in dsts), f"{name}: a block moved into a free block"


def _check_batch(scheduler: "Scheduler", out: "SchedulerOutput") -> None:
    """The worker's copy of the step (`out.batch`, plain data) says what the step does:
    the same sequences, tokens, current block tables, sampling rows and block moves."""
    batch = out.batch
    by_id = {s.seq.seq_id: s for s in out.scheduled}
    assert sorted(by_id) == sorted(t.seq_id for t in batch.seqs), "the batch names other sequences than the step"
    for t in batch.seqs:
        s = by_id[t.seq_id]
        assert t.start == s.start and t.token_ids == s.seq.token_ids[s.start:s.start + s.num_new_tokens], (
            f"sequence {t.seq_id}: the batch computes other tokens")
        assert t.block_ids == scheduler.kv.block_ids(t.seq_id), f"sequence {t.seq_id}: stale block table in the batch"
        assert (t.sample is not None) == s.samples, f"sequence {t.seq_id}: the batch samples where the step does not"
    assert [s.seq.seq_id for s in out.sampled] == [t.seq_id for t in batch.seqs if t.sample is not None]
    assert (batch.swap_out, batch.swap_in, batch.block_copies) == (out.swap_out, out.swap_in, out.block_copies), \
        "the batch moves other blocks than the step"
