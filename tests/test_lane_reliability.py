"""The tokenizer lanes (engine/tokenizer.py TokenizerLane) are bounded (issue 51): a lane holds
at most max_jobs requests (the running one and those queued behind it); one more gets the full
queue's refusal (QueueFullError; the server's 503 with Retry-After) at once, and nothing is left
behind: no KV blocks, no stuck futures, the lane's count back to 0. Each test holds a lane's
thread on a gate it opens itself and counts outcomes (never times)."""
from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from pagedserve import SamplingParams
from pagedserve.engine.protocol import QueueFullError
from pagedserve.engine.tokenizer import TokenizerLane
from pagedserve.errors import InvalidRequestError
from tests.conftest import wait_for
from tests.fault_server import HOLD_RENDER, SLOW_STEPS
from tests.fault_server import install as install_faults
from tests.server_utils import API_KEY, api_server_args, served, wait_idle
from tests.test_async_llm import PROMPT, async_llm, run

GATE_WAIT_S = 60.0   # a bound on waiting for the server's state, never asserted on


def _held(lane: TokenizerLane, gate: threading.Event, ran: list) -> tuple[asyncio.Future, threading.Event]:
    """A job that holds the lane's thread until `gate` is set."""
    started = threading.Event()

    def hold(_tokenizer):
        started.set()
        gate.wait(2 * GATE_WAIT_S)   # longer than any wait of the test: its deadline fires first
        ran.append("held")
    job = asyncio.ensure_future(lane.run(hold))
    return job, started


def test_a_full_lane_refuses_at_once_and_a_cancelled_waiter_leaves_its_queue():
    async def body():
        lane = TokenizerLane("test-lane", object(), copy_tokenizer=False, max_jobs=3)
        gate, ran = threading.Event(), []
        held, started = _held(lane, gate, ran)
        await asyncio.to_thread(started.wait, GATE_WAIT_S)
        waiters = [asyncio.ensure_future(lane.run(lambda _t, i=i: ran.append(i) or i)) for i in range(2)]
        await asyncio.sleep(0)
        assert lane.num_jobs == 3
        with pytest.raises(QueueFullError, match="at most 3 may wait"):
            await lane.run(lambda _t: ran.append("over"))
        waiters[0].cancel()                       # its client left: it leaves the queue, never runs
        with pytest.raises(asyncio.CancelledError):
            await waiters[0]
        assert lane.num_jobs == 2
        late = asyncio.ensure_future(lane.run(lambda _t: ran.append("late") or "late"))
        await asyncio.sleep(0)
        gate.set()
        assert await held is None and await waiters[1] == 1 and await late == "late"
        assert ran == ["held", 1, "late"] and lane.num_jobs == 0
        lane.close()
    asyncio.run(body())


def test_async_llm_refuses_text_prompts_beyond_its_lane_with_queue_full(tiny_llama, monkeypatch):
    """The queue is full (one runs, two wait): each over-long text prompt is tokenized on the
    lane to be answered as bad (InvalidRequestError); the lane holds max_waiting_requests (2) of
    them, the held job included, and refuses the rest with QueueFullError. Twice: the lane's
    count comes back; the engine holds only its three requests, no blocks beyond theirs."""
    install_faults(monkeypatch.setattr)
    llm = async_llm(tiny_llama, max_waiting_requests=2, max_num_seqs=1)
    slow = SamplingParams(temperature=0, ignore_eos=True, max_tokens=300)
    too_long = " x" * 600

    async def body():
        running = await llm.add_requests([("run", f"{PROMPT} {SLOW_STEPS}", slow)])
        await running.__aiter__().__anext__()
        waiting = [await llm.add_requests([(f"w{i}", f"{PROMPT} {SLOW_STEPS}", slow)]) for i in range(2)]
        for round_ in range(2):
            gate, ran = threading.Event(), []
            held, started = _held(llm._prompts, gate, ran)
            await asyncio.to_thread(started.wait, GATE_WAIT_S)
            calls = [asyncio.ensure_future(llm.add_requests([(f"bad{round_}-{i}", too_long,
                                                              SamplingParams(max_tokens=1))])) for i in range(5)]
            deadline = time.monotonic() + GATE_WAIT_S
            while sum(c.done() for c in calls) < 4:   # the refusals come while the lane is held
                assert time.monotonic() < deadline, "no refusals while the lane is held"
                await asyncio.sleep(0.01)
            refused = [c for c in calls if c.done()]
            gate.set()
            await held
            outcomes = await asyncio.gather(*calls, return_exceptions=True)
            assert [type(o) for o in outcomes].count(InvalidRequestError) == 1, outcomes
            assert [type(o) for o in outcomes].count(QueueFullError) == 4, outcomes
            assert all(isinstance(c.exception(), QueueFullError) for c in refused) and len(refused) == 4
            assert llm._prompts.num_jobs == 0
        assert set(llm.engine.requests) == {"run", "w0", "w1"}
        for stream in [running, *waiting]:
            stream.close()
    run(llm, body)


LIMIT = 3   # --max-waiting-requests: each lane holds 3 requests


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    yield from served(tiny_llama.path, tmp_path_factory.mktemp("lanes"), api_server_args(
        "--max-waiting-requests", str(LIMIT)), module="tests.fault_server")


def _chat(gate: Path) -> dict:
    return {"model": "tiny", "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "user", "content": f"{PROMPT} {HOLD_RENDER}{gate} please"}]}


@pytest.mark.parametrize("round_", [0, 1])
def test_the_server_answers_a_full_tokenizer_lane_with_the_full_queues_503(server, tmp_path, round_):
    """One chat holds the small lane's thread (its render waits for a gate), 6 more come: LIMIT - 1
    of them wait in the lane, the others get 503 with Retry-After at once; the gate opens and
    every one let in answers 200. Nothing stays: the engine is idle, its KV cache empty (and the
    second round, on the same server, counts the same: the lane's count came back to 0)."""
    gate = tmp_path / f"gate{round_}"
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as http, \
            ThreadPoolExecutor(8) as pool:
        first = pool.submit(http.post, "/v1/chat/completions", json=_chat(gate))
        wait_for(lambda: Path(f"{gate}.held").exists(), "the first render to hold the lane", timeout=GATE_WAIT_S,
                 interval=0.01)
        rest = [pool.submit(http.post, "/v1/chat/completions", json=_chat(gate)) for _ in range(6)]
        wait_for(lambda: sum(f.done() for f in rest) >= 6 - (LIMIT - 1), "the refusals", timeout=GATE_WAIT_S, interval=0.01)
        refused = [f.result() for f in rest if f.done()]
        gate.touch()
        answers = [first.result()] + [f.result() for f in rest]
        statuses = sorted(r.status_code for r in answers)
        assert statuses == [200] * LIMIT + [503] * (7 - LIMIT), [r.text for r in answers]
        assert all(r.status_code == 503 for r in refused)
        for r in refused:
            assert r.headers["Retry-After"] == "1" and "--max-waiting-requests" in r.json()["error"]["message"]
        m = wait_idle(http, timeout=30)
        assert m["pagedserve:kv_cache_usage_perc"] == 0 and m["pagedserve:num_requests_waiting"] == 0
        assert m["pagedserve:num_requests_running"] == 0
