"""DataParallelLLM's routing of adds, over stand-in replica handles (no Ray cluster, no
model): a replica that fails before taking a request has it routed again, one that
refuses it (bad input) does not, and a replica dying mid-stream fails only its request."""
import asyncio

import pytest

from pagedserve.config import EngineConfig
from pagedserve.errors import InvalidRequestError
from pagedserve.outputs import CompletionOutput, RequestOutput
from pagedserve.sampling_params import SamplingParams

pytest.importorskip("ray")
from ray.exceptions import RayActorError  # noqa: E402

from pagedserve.cluster.client import DataParallelLLM  # noqa: E402
from pagedserve.server.metrics import PrometheusStatLogger  # noqa: E402
from pagedserve.cluster.replica import describe_error  # noqa: E402


async def _value(v):
    return v


class Stream:
    """What a replica's generate() streaming generator gives: refs to (kind, value) items; an
    exception item stands for the actor dying there."""

    def __init__(self, items):
        self.items = list(items)

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.items:
            raise StopAsyncIteration
        item = self.items.pop(0)
        if isinstance(item, BaseException):
            raise item
        return _value(item)


class Method:
    def __init__(self, fn):
        self.remote = fn


class Replica:
    def __init__(self, script):
        self.script = script          # request id -> the items its stream gives
        self.calls: list[str] = []
        self.generate = Method(self._generate)
        self.abort = Method(lambda ids: None)

    def _generate(self, rid, prompt, params):
        self.calls.append(rid)
        return Stream(self.script(rid))


def output(rid: str, finished: bool, cached: int = 0) -> RequestOutput:
    return RequestOutput(rid, None, [1, 2, 3], None, [CompletionOutput(0, "x", [5], None, None,
                                                                        "length" if finished else None)],
                         finished, num_cached_tokens=cached)


def client(*replicas, policy="round_robin") -> DataParallelLLM:
    metrics = PrometheusStatLogger("m", num_engines=len(replicas))
    llm = DataParallelLLM(EngineConfig(), len(replicas), metrics, routing_policy=policy)
    llm.actors, llm.state = list(replicas), "ready"
    return llm


def run(coro):
    return asyncio.run(coro)


ITEM = ("r", {"prompt": None, "prompt_token_ids": list(range(40))}, SamplingParams(max_tokens=1))


def test_a_replica_dead_before_the_add_has_it_routed_again():
    dead = Replica(lambda rid: [RayActorError()])
    live = Replica(lambda rid: [("added", None), ("output", output(rid, True, cached=16))])
    llm = client(dead, live)

    async def go():
        outs = []
        for i in range(2):   # round robin tries the dead one for one of them
            stream = await llm.add_requests([(f"r{i}", *ITEM[1:])])
            outs += [o async for o in stream]
        return outs
    outs = run(go())
    assert [o.request_id for o in outs] == ["r0", "r1"] and all(o.finished for o in outs)
    assert len(dead.calls) == 1 and live.calls == ["r0", "r1"]
    assert llm.router.counters.decisions["round_robin"] == 3          # the retry was routed too
    assert not llm.router.replicas[0].alive and llm.router.replicas[1].in_flight == 0


def test_a_refusal_is_raised_not_rerouted():
    refuse = Replica(lambda rid: [("error", describe_error(InvalidRequestError("too long", "prompt",
                                                                               "context_length_exceeded")))])
    llm = client(refuse, refuse)
    with pytest.raises(InvalidRequestError) as e:
        run(llm.add_requests([ITEM]))
    assert (e.value.param, e.value.code) == ("prompt", "context_length_exceeded")
    assert len(refuse.calls) == 1 and all(r.in_flight == 0 for r in llm.router.replicas)


def test_a_replica_dying_mid_stream_fails_only_its_request():
    dies = Replica(lambda rid: [("added", None), ("output", output(rid, False)), RayActorError()])
    fine = Replica(lambda rid: [("added", None), ("output", output(rid, False)), ("output", output(rid, True))])
    llm = client(dies, fine)

    async def go():
        streams = {rid: await llm.add_requests([(rid, *ITEM[1:])]) for rid in ("a", "b")}
        (doomed,), (other,) = dies.calls, fine.calls
        got = [o async for o in streams[other]]
        with pytest.raises(Exception) as e:
            [o async for o in streams[doomed]]
        return got, e.value
    got, error = run(go())
    assert got[-1].finished and "replica 0 died" in str(error)
    assert not llm.router.replicas[0].alive and llm.router.replicas[1].alive


def test_the_client_is_an_engine_client_and_refuses_the_one_engine_dashboard():
    from pagedserve.engine.async_llm import EngineNotReadyError
    from pagedserve.engine.protocol import EngineClient
    llm = client(Replica(lambda rid: []), Replica(lambda rid: []))
    assert isinstance(llm, EngineClient)
    with pytest.raises(EngineNotReadyError, match="2 data-parallel replicas"):
        run(llm.kv_capture())
    llm.max_waiting_requests = 4
    with pytest.raises(ValueError, match="at most 4"):
        llm.check_num_prompts(5)
