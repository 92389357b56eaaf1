"""The data-parallel router's counters and index stay exact across a replica's restart (issue
34), over stand-in replica handles (tests/test_cluster_client.py's fakes; no Ray cluster, no
model): a rerouted request's expected hit tokens count once; a dead incarnation's late request
ends do not move the new incarnation's in-flight count (nor mark it down); and the KV events of
a restarted replica's first poll reach the index."""
from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("ray")
from ray.exceptions import RayActorError  # noqa: E402

from pagedserve.cluster.replica import PollResult, ReplicaInfo  # noqa: E402
from pagedserve.kv.block_pool import lookup_block_keys  # noqa: E402
from tests.test_cluster_client import ITEM, Method, Replica, Stream, client, output  # noqa: E402

PROMPT = ITEM[1]["prompt_token_ids"]


def info(incarnation: str) -> ReplicaInfo:
    return ReplicaInfo(incarnation, "m", 512, 400, 64, 16, {})


def test_a_rerouted_request_counts_its_expected_hits_once():
    dead = Replica(lambda rid: [RayActorError()])
    live = Replica(lambda rid: [("added", None), ("output", output(rid, True))])
    llm = client(dead, live)
    keys = lookup_block_keys(PROMPT, llm.router.block_size)
    for i in (0, 1):   # both caches hold the prompt's blocks: each route expects them
        llm.router.apply_events(i, [("stored", k) for k in keys])

    async def go():
        for i in range(2):   # round robin tries the dead one for one of them
            stream = await llm.add_requests([(f"r{i}", *ITEM[1:])])
            [o async for o in stream]
    asyncio.run(go())
    assert len(dead.calls) == 1 and llm.router.counters.decisions["round_robin"] == 3
    expected = 2 * len(keys) * llm.router.block_size       # two requests, each counted once
    assert llm.router.counters.estimated_hit_tokens == expected
    assert llm.router.counters.prompt_tokens == 2 * len(PROMPT)
    assert llm.router.counters.rerouted == 1
    assert llm._estimated._value.get() == expected


class HeldStream(Stream):
    """A stream that waits for `release` before its next item."""

    def __init__(self, items, release: asyncio.Event):
        super().__init__(items)
        self.release = release

    async def __anext__(self):
        if len(self.items) == 1:
            await self.release.wait()
        return await super().__anext__()


def test_a_dead_incarnations_late_request_ends_leave_the_new_one_alone():
    async def go():
        release = asyncio.Event()
        old_done = asyncio.Event()
        replica = Replica(lambda rid: [])
        # r0 runs on the first incarnation, which dies; its stream only ends later (late decrement).
        replica.generate = Method(lambda rid, p, s: HeldStream(
            [("added", None), ("output", output(rid, False)), RayActorError()], release) if rid == "r0" else
            HeldStream([("added", None), ("output", output(rid, False)), ("output", output(rid, True))], old_done))
        llm = client(replica)
        old = await llm.add_requests([("r0", *ITEM[1:])])
        await asyncio.sleep(0)
        llm._replica_down(0)                       # the replica died; Ray restarted it
        llm._rejoin(0, info("second"))
        new = await llm.add_requests([("r1", *ITEM[1:])])
        assert llm.router.replicas[0].in_flight == 1
        release.set()                              # the dead incarnation's request ends now
        with pytest.raises(Exception):
            [o async for o in old]
        await asyncio.sleep(0)
        assert llm.router.replicas[0].alive, "a dead incarnation's error marked the new one down"
        assert llm.router.replicas[0].in_flight == 1, "a dead incarnation's request end was counted"
        old_done.set()
        assert [o async for o in new][-1].finished
        assert llm.router.replicas[0].in_flight == 0
    asyncio.run(go())


def test_the_first_poll_of_a_restarted_replica_reaches_the_index():
    keys = lookup_block_keys(PROMPT, 16)

    async def go():
        polls = [PollResult("second", "ready", [("cleared", None)] + [("stored", k) for k in keys], None, [])]

        async def poll():
            if polls:
                return polls.pop(0)
            await asyncio.sleep(3600)

        async def start():
            return info("second")
        replica = Replica(lambda rid: [])
        replica.poll, replica.start = Method(poll), Method(start)
        llm = client(replica)
        llm.infos = [info("first")]
        llm.router.apply_events(0, [("stored", b"stale")])
        task = asyncio.create_task(llm._monitor(0))
        for _ in range(100):
            await asyncio.sleep(0.01)
            if llm.infos[0].incarnation == "second" and llm.router.index.keys[0]:
                break
        task.cancel()
        assert llm.infos[0].incarnation == "second"
        assert llm.router.index.keys[0] == set(keys)    # the stale key gone, the new ones there
        assert llm.router.replicas[0].alive
    asyncio.run(go())
