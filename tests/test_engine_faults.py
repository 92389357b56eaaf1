"""Faults on the engine thread: none may leave a request hanging or /health lying.

Faults are injected with tests/fault_server.py (by a marker in the prompt text).
A fault in one request's processing fails that request alone; a step that fails
as a whole fails the requests in flight and the engine goes on; a fault outside
any request kills the engine: /health 503, requests 5xx at once, exit status 1.
A request that must still be running when the fault comes is marked SLOW_STEPS (each of its
steps takes 20 ms longer), so that no machine is fast enough to finish it first.
"""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.engine.llm_engine import RequestsFailed
from pagedserve.server.launcher import launch_server
from tests import fault_server
from tests.fault_server import FATAL_FAULT, REQUEST_FAULT, SLOW_STEPS, STEP_FAULT
from tests.server_utils import KV_BLOCKS, PROMPT, served, sse_events, tiny_server_args, wait_idle
from tests.test_engine import assert_no_blocks_held, make_llm

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def offline(tiny_llama):
    return LLM(tiny_llama.path, dtype="float32", num_gpu_blocks_override=KV_BLOCKS)


def reference_text(offline, prompt: str, max_tokens: int) -> str:
    return offline.generate(prompt, SamplingParams(max_tokens=max_tokens, **GREEDY), use_tqdm=False)[0].outputs[0].text


# ---- the engine alone ---------------------------------------------------------------------------
def test_a_fault_in_one_request_drops_it_and_the_step_goes_on(tiny_llama, monkeypatch):
    fault_server.install(monkeypatch.setattr)
    llm = make_llm(tiny_llama, block_size=4)
    engine, params = llm.engine, SamplingParams(max_tokens=10, **GREEDY)
    engine.add_request("bad", f"{PROMPT} {REQUEST_FAULT}", params)
    engine.add_request("good", PROMPT, params)
    failures, final = {}, None
    while engine.has_unfinished_requests():
        try:
            outputs = engine.step()
        except RequestsFailed as e:
            failures.update(e.failures)
            outputs = e.outputs
            assert [o.request_id for o in outputs] == ["good"]   # the same step went on for it
        final = next((o for o in outputs if o.request_id == "good" and o.finished), final)
    assert list(failures) == ["bad"] and "injected" in str(failures["bad"])
    monkeypatch.undo()
    ref = make_llm(tiny_llama, block_size=4).generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    assert final.outputs[0].token_ids == ref.token_ids
    assert_no_blocks_held(llm)


def test_offline_llm_after_a_failed_step_does_not_read_its_half_written_blocks(tiny_llama, monkeypatch):
    """The failed step allocated blocks for the prompt's prefix (entering them in the prefix
    cache) and never wrote them: a later prompt with that prefix must compute it."""
    fault_server.install(monkeypatch.setattr)
    prefix = "An operating system maps pages of virtual memory to physical frames. " * 3
    params = SamplingParams(max_tokens=10, **GREEDY)
    llm = make_llm(tiny_llama, block_size=4)
    with pytest.raises(fault_server.InjectedFault):
        llm.generate(prefix + STEP_FAULT, params, use_tqdm=False)
    assert_no_blocks_held(llm)
    clean = prefix + "Continuous batching"
    got = llm.generate(clean, params, use_tqdm=False)[0].outputs[0].token_ids
    assert got == make_llm(tiny_llama, block_size=4).generate(clean, params, use_tqdm=False)[0].outputs[0].token_ids


# ---- the server: the engine goes on -------------------------------------------------------------
@pytest.fixture(scope="module")
def faulty_server(tiny_llama, tmp_path_factory):
    yield from served(tiny_llama.path, tmp_path_factory.mktemp("faults"),
                      tiny_server_args("--shutdown-timeout", "0", "--enable-responses-api-store"),
                      module="tests.fault_server")


def stream_alongside(http: httpx.Client, prompt: str, max_tokens: int, during) -> tuple[str, list]:
    """Stream a greedy completion; once its first tokens have come, call during() and return its
    result with the streamed text and events."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, **GREEDY}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        first = [next(lines) for _ in range(4)]
        result = during()
        events = sse_events(first + list(lines))
    text = "".join(e["choices"][0]["text"] for e in events if isinstance(e, dict) and e.get("choices"))
    return result, text, events


def test_a_fault_in_one_request_fails_it_alone(faulty_server, offline):
    with httpx.Client(base_url=faulty_server.url, timeout=60) as http:
        bad = {"prompt": f"{PROMPT} {REQUEST_FAULT}", "max_tokens": 20, **GREEDY}
        r, text, _ = stream_alongside(http, PROMPT, 300, lambda: http.post("/v1/completions", json=bad))
        assert r.status_code == 500 and "injected fault in one request" in r.json()["error"]["message"], r.text
        assert text == reference_text(offline, PROMPT, 300)
        assert http.get("/health").status_code == 200
        assert wait_idle(http)["pagedserve:kv_cache_usage_perc"] == 0
        ok = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 12, **GREEDY})
        assert ok.json()["choices"][0]["text"] == reference_text(offline, PROMPT, 12)


def test_a_failed_step_fails_the_requests_in_flight_and_the_engine_goes_on(faulty_server, offline):
    with httpx.Client(base_url=faulty_server.url, timeout=60) as http:
        # The failed step allocated (and entered in the prefix cache) blocks for the prefix that it
        # never wrote: a later prompt with that prefix must not find them.
        prefix = "An operating system maps pages of virtual memory to physical frames. " * 3
        bad = {"prompt": f"{prefix}{STEP_FAULT}", "max_tokens": 20, **GREEDY}
        r, _, events = stream_alongside(http, f"{PROMPT} {SLOW_STEPS}", 300,
                                        lambda: http.post("/v1/completions", json=bad))
        assert r.status_code == 500 and "injected fault in a model step" in r.json()["error"]["message"], r.text
        errors = [e["error"] for e in events if isinstance(e, dict) and "error" in e]
        assert errors and "injected fault in a model step" in errors[0]["message"]   # failed with it
        assert events[-1] == "[DONE]"
        assert http.get("/health").status_code == 200
        assert wait_idle(http)["pagedserve:kv_cache_usage_perc"] == 0
        clean = prefix + "Continuous batching"
        for _ in range(2):
            ok = http.post("/v1/completions", json={"prompt": clean, "max_tokens": 20, **GREEDY})
            assert ok.json()["choices"][0]["text"] == reference_text(offline, clean, 20)
    assert "Traceback" in faulty_server.log()   # each fault is logged with its traceback


def test_a_fault_in_a_streamed_response_ends_it_failed_and_stored_so(faulty_server, offline):
    """/v1/responses streamed: an engine error mid-stream is a response.failed event and an error
    event (not a cut stream), the stored response says failed, and the engine goes on."""
    with httpx.Client(base_url=faulty_server.url, timeout=60) as http:
        body = {"input": f"{PROMPT} {REQUEST_FAULT}", "max_output_tokens": 20, "stream": True,
                "store": True, "temperature": 0}
        with http.stream("POST", "/v1/responses", json=body) as r:
            assert r.status_code == 200
            events = [json.loads(line[len("data: "):]) for line in r.iter_lines() if line.startswith("data: ")]
        kinds = [e["type"] for e in events]
        assert kinds[0] == "response.created" and kinds[-2:] == ["response.failed", "error"], kinds
        assert "injected fault in one request" in events[-1]["message"]
        stored = http.get(f"/v1/responses/{events[0]['response']['id']}").json()
        assert stored["status"] == "failed" and "injected fault" in stored["error"]["message"]
        assert wait_idle(http)["pagedserve:kv_cache_usage_perc"] == 0
        ok = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 12, **GREEDY})
        assert ok.json()["choices"][0]["text"] == reference_text(offline, PROMPT, 12)


# ---- the server: the engine dies ----------------------------------------------------------------
def test_a_dead_engine_fails_everything_at_once_and_health_says_503(tiny_llama, monkeypatch):
    """In process (the app's lifespan on an ASGI transport): after a fault outside any request,
    the request in flight gets a 500, /health and new requests 503, and the server is told to stop."""
    from pagedserve.config import EngineConfig
    from pagedserve.engine.async_llm import AsyncLLM
    from pagedserve.server.app import build_app
    from pagedserve.server.state import ServerState
    from pagedserve.server.metrics import PrometheusStatLogger

    fault_server.install(monkeypatch.setattr)
    config = EngineConfig(model=tiny_llama.path, dtype="float32", num_gpu_blocks_override=KV_BLOCKS)
    state = ServerState(AsyncLLM(config, log_interval=None), ["tiny"], PrometheusStatLogger("tiny"))
    stopped = []
    state.on_engine_dead = lambda: stopped.append(True)
    app = build_app(state)

    async def scenario():
        async with app.router.lifespan_context(app):
            await state.llm.wait_started()
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                         timeout=60) as c:
                assert (await c.get("/health")).status_code == 200
                long = asyncio.create_task(c.post("/v1/completions",
                                                  json={"prompt": f"{PROMPT} {SLOW_STEPS}", "max_tokens": 400,
                                                        **GREEDY}))
                while state.llm.scheduler_stats.num_running == 0:
                    await asyncio.sleep(0.005)
                fatal = await c.post("/v1/completions", json={"prompt": FATAL_FAULT, "max_tokens": 5})
                in_flight = await asyncio.wait_for(long, 30)
                await asyncio.wait_for(state.llm.wait_dead(), 30)
                return (fatal, in_flight, await c.get("/health"),
                        await c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 5}))

    fatal, in_flight, health, after = asyncio.run(scenario())
    assert fatal.status_code in (500, 503), fatal.text
    assert in_flight.status_code == 500 and "cannot go on" in in_flight.json()["error"]["message"], in_flight.text
    assert health.status_code == 503 and "dead" in health.json()["error"]["message"]
    assert after.status_code == 503
    assert stopped == [True] and state.llm.state == "dead"


def test_a_dead_engine_exits_the_server_with_status_1(tiny_llama, tmp_path):
    srv = launch_server(tiny_llama.path, tiny_server_args(), tmp_path / "server.log", module="tests.fault_server")
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            got: dict = {}

            def kill_it():
                got["r"] = http.post("/v1/completions", json={"prompt": FATAL_FAULT, "max_tokens": 5})
            _, _, events = stream_alongside(http, f"{PROMPT} {SLOW_STEPS}", 400, kill_it)
        assert got["r"].status_code in (500, 503)
        errors = [e["error"] for e in events if isinstance(e, dict) and "error" in e]
        assert errors and errors[0]["code"] is None and "cannot go on" in errors[0]["message"]
        assert srv.proc.wait(60) == 1, srv.log()[-3000:]
        assert "cannot go on" in srv.log()
    finally:
        srv.stop()
