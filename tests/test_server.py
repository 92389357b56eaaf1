"""The OpenAI-compatible server, run as a real subprocess on a free local port.

One server on a tiny random Llama serves most tests (it checks the paging
invariants after every step: PAGEDSERVE_CHECK_INVARIANTS is inherited); its
answers are compared with the offline LLM on the same model. It runs with
tests/fault_server.py installed: a test that must find a request still running
(a disconnect, a SIGTERM, requests sharing steps) marks its prompt SLOW_STEPS, so
that however fast the machine, the request takes at least 20 ms a step. Separate servers
cover SIGTERM and the real default model; the 503-while-starting gate is
tested in process. Bad input and limits: test_server_bad_input.py; load and
client faults: test_server_load.py.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
import signal
import socket
import threading
import time

import httpx
import openai
import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.server.launcher import launch_server
from tests.fault_server import SLOW_STEPS
from tests.server_utils import (API_KEY, KV_BLOCKS, PROMPT, api_server_args, metrics, served, sse_events, tiny_server_args,
                                wait_idle)


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    yield from served(tiny_llama.path, tmp_path_factory.mktemp("server"), api_server_args(names=("tiny", "t2")),
                      module="tests.fault_server")


@pytest.fixture(scope="module")
def offline(tiny_llama):
    """The offline engine on the same model: the reference for the server's answers."""
    return LLM(tiny_llama.path, dtype="float32", num_gpu_blocks_override=KV_BLOCKS)


def reference(offline, prompt, **kw):
    return offline.generate(prompt, SamplingParams(**kw), use_tqdm=False)[0]


# ---- basics -------------------------------------------------------------------------------------
def test_health_version_models_tokenize(server, client, http):
    assert httpx.get(server.url + "/health").status_code == 200          # no key needed
    head = httpx.head(server.url + "/health")                           # load balancers ask with HEAD
    assert head.status_code == 200 and head.content == b""
    assert httpx.get(server.url + "/version").json()["version"]
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny", "t2"]
    ids = http.post("/tokenize", json={"prompt": PROMPT}).json()
    assert ids["count"] == len(ids["tokens"]) > 3 and ids["max_model_len"] == 512
    assert http.post("/detokenize", json={"tokens": ids["tokens"]}).json()["prompt"].endswith(PROMPT)


def test_completion_matches_offline_engine(client, offline, tiny_llama):
    ref = reference(offline, PROMPT, temperature=0, max_tokens=24, ignore_eos=True)
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == ref.outputs[0].text
    assert r.choices[0].finish_reason == "length"
    assert r.model == "tiny"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ref.prompt_token_ids), 24)
    assert r.usage.total_tokens == len(ref.prompt_token_ids) + 24
    # Token ids as the prompt, and a list of prompts: one choice each, in order.
    ids = tiny_llama.tokenizer.encode(PROMPT)
    r2 = client.completions.create(model="t2", prompt=[ids, ids[:4]], max_tokens=24, temperature=0,
                                   extra_body={"ignore_eos": True})
    assert [c.index for c in r2.choices] == [0, 1]
    assert r2.choices[0].text == ref.outputs[0].text
    assert r2.usage.prompt_tokens == len(ids) + 4 and r2.usage.completion_tokens == 48


def test_streaming_completion_equals_non_streaming(client):
    # Slowed steps: the 20 tokens take at least 400 ms, so they cannot all be ready at the first read.
    kw = dict(model="tiny", prompt=f"{PROMPT} {SLOW_STEPS}", max_tokens=20, temperature=0,
              extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    # Streamed, not all at once. How many pieces depends on how fast the client reads (a slow
    # reader gets the tokens since its last read in one chunk), so only "more than one".
    assert len([c for c in chunks if c.choices]) >= 2
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_chat_streaming_and_not(client, http, offline, tiny_llama):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "The quick brown fox"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0)
    ids = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
    ref = offline.chat(messages, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    assert ids == ref.prompt_token_ids
    assert whole.choices[0].message.content == ref.outputs[0].text
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens == len(ids)
    assert whole.usage.completion_tokens == len(ref.outputs[0].token_ids)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref.outputs[0].finish_reason
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens
    # max_completion_tokens wins over max_tokens
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, max_completion_tokens=3,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


def test_n_and_seeded_sampling_reproducible(client):
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.0, n=3, extra_body={"ignore_eos": True})
    a = client.completions.create(**kw, seed=11)
    b = client.completions.create(**kw, seed=11)
    c = client.completions.create(**kw, seed=12)
    assert [ch.index for ch in a.choices] == [0, 1, 2]
    assert [ch.text for ch in a.choices] == [ch.text for ch in b.choices]
    assert [ch.text for ch in a.choices] != [ch.text for ch in c.choices]
    assert len({ch.text for ch in a.choices}) > 1        # each sequence has its own generator
    assert a.usage.completion_tokens == 24
    # Streaming n > 1 interleaves the choices and gives the same texts.
    texts = ["", "", ""]
    for chunk in client.completions.create(**kw, seed=11, stream=True):
        for ch in chunk.choices:
            texts[ch.index] += ch.text
    assert texts == [ch.text for ch in a.choices]
    # best_of > n returns the n most likely of best_of samples.
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=1.0, n=2, best_of=3,
                                  seed=5)
    assert len(r.choices) == 2


def test_completion_logprobs_and_echo(client, tiny_llama):
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and 1 <= len(top) <= 4
        assert logprob == pytest.approx(max(top.values()), abs=1e-5)      # greedy takes the top token
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    e = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=1, echo=True,
                                  extra_body={"ignore_eos": True})
    n_prompt = len(tiny_llama.tokenizer.encode(PROMPT))
    assert e.choices[0].text == PROMPT + r.choices[0].text
    assert len(e.choices[0].logprobs.tokens) == n_prompt + 8
    assert e.choices[0].logprobs.token_logprobs[0] is None
    assert e.choices[0].logprobs.token_logprobs[n_prompt:] == pytest.approx(lp.token_logprobs, abs=1e-5)


def test_chat_logprobs(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Keys and values"}],
                                       max_tokens=6, temperature=0, logprobs=True, top_logprobs=2,
                                       extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 6
    for pos in content:
        assert [t.logprob for t in pos.top_logprobs] == sorted((t.logprob for t in pos.top_logprobs), reverse=True)
        assert len(pos.top_logprobs) == 2 and pos.logprob == pytest.approx(pos.top_logprobs[0].logprob, abs=1e-5)


def test_stop_strings(client):
    kw = dict(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    text = client.completions.create(**kw).choices[0].text
    match = re.search(r"[A-Za-z]{2}", text[3:])
    assert match, f"no ascii pair to stop at in {text!r}"
    stop = match.group(0)
    before = text[:text.index(stop)]
    r = client.completions.create(**kw, stop=[stop, "never-there"])
    assert r.choices[0].text == before
    assert r.choices[0].finish_reason == "stop" and r.choices[0].model_extra["stop_reason"] == stop
    assert r.usage.completion_tokens < 40
    kept = client.completions.create(**{**kw, "extra_body": {"ignore_eos": True, "include_stop_str_in_output": True}},
                                     stop=stop)
    assert kept.choices[0].text == before + stop
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stop=stop, stream=True))
    assert streamed == before


def test_beam_search(client):
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, n=2, best_of=3,
                                  extra_body={"use_beam_search": True, "ignore_eos": True})
    assert len(r.choices) == 2 and all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 12


# ---- errors -------------------------------------------------------------------------------------
def test_api_key_enforced(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "x"}, headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert httpx.get(server.url + "/metrics").status_code == 200
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


# ---- cancellation and batching ------------------------------------------------------------------
def test_disconnect_mid_stream_frees_blocks(http, client, offline):
    before = wait_idle(http)
    ref = reference(offline, "Keys and values", temperature=0, max_tokens=60, ignore_eos=True)
    other: dict = {}

    def run_other():   # a request that runs alongside and must not notice the abort
        other["r"] = client.completions.create(model="tiny", prompt="Keys and values", max_tokens=60,
                                               temperature=0, extra_body={"ignore_eos": True})

    # Slowed steps: its 400 tokens take at least 8 s, so it is still running when the client leaves.
    body = {"prompt": f"{PROMPT} {SLOW_STEPS}", "max_tokens": 400, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(12)]
        assert any(line.startswith("data: ") for line in got)
        thread = threading.Thread(target=run_other)
        thread.start()
        during = metrics(http)
        assert during["pagedserve:num_requests_running"] >= 1
        assert during["pagedserve:kv_cache_usage_perc"] > 0
    # Leaving the `with` closed the connection mid-stream: the request is aborted at once.
    aborts = 'pagedserve:request_success_total{finished_reason="abort"}'
    deadline = time.monotonic() + 30
    while metrics(http)[aborts] == before[aborts]:
        assert time.monotonic() < deadline, "the disconnected request was not aborted"
        time.sleep(0.02)
    thread.join(60)
    after = wait_idle(http)
    assert after["pagedserve:kv_cache_usage_perc"] == 0, "the aborted request's blocks were not freed"
    assert after["pagedserve:num_requests_running"] == 0
    assert after[aborts] == before[aborts] + 1
    assert other["r"].choices[0].text == ref.outputs[0].text
    # It stopped long before its 400 tokens (the other request's 60 count too).
    gen = "pagedserve:generation_tokens_total"
    assert after[gen] - before[gen] < 400


def test_concurrent_requests_complete_and_share_batches(server, http, offline):
    """8 streams sent at once run in shared steps. Slowed steps (at least 20 ms each) keep the
    time between the client's first and last request (which grows with load) short against
    a step, so the count of steps below does not depend on how fast the server steps."""
    before = wait_idle(http)
    prompts = [f"{p} {SLOW_STEPS}" for p in ["The quick brown fox", "Paged attention stores", "def add(a, b):", "one",
                                             PROMPT, "Keys and values", "An operating system maps pages",
                                             "Continuous batching"]]
    refs = offline.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    refs = [r.outputs[0].text for r in refs]   # batch invariance: the same as each alone

    async def run():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)

        async def one(prompt):
            text = ""
            stream = await aclient.completions.create(model="tiny", prompt=prompt, max_tokens=32, temperature=0,
                                                      stream=True, extra_body={"ignore_eos": True})
            async for chunk in stream:
                text += chunk.choices[0].text
            return text
        return await asyncio.gather(*(one(p) for p in prompts))

    assert asyncio.run(run()) == refs
    after = wait_idle(http)
    gen = "pagedserve:generation_tokens_total"
    steps = "pagedserve:iteration_tokens_total_count"
    assert after[gen] - before[gen] == 8 * 32
    # One request alone takes 32 steps; 8 in turn would take 256. Batched, they take a few more than 32.
    assert after[steps] - before[steps] < 100
    ok = 'pagedserve:request_success_total{finished_reason="length"}'
    assert after[ok] - before[ok] == 8


def test_cache_salt_separates_prefix_cache_tenants(http):
    """cache_salt on completions and chat: a request hits the prefix cache only for blocks cached
    under its own salt, and the answer does not depend on the salt."""
    prompt = "Tenant separation: " + " ".join(f"w{i}" for i in range(40))   # several full blocks
    messages = [{"role": "user", "content": prompt}]

    def hits(path, body):
        before = metrics(http)["pagedserve:prefix_cache_hits_total"]
        r = http.post(path, json={**body, "max_tokens": 4, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        return metrics(http)["pagedserve:prefix_cache_hits_total"] - before, choice.get("text", choice.get("message"))

    for path, body in (("/v1/completions", {"prompt": prompt}), ("/v1/chat/completions", {"messages": messages})):
        cold, ref = hits(path, {**body, "cache_salt": "tenant-a"})
        assert cold == 0
        assert hits(path, {**body, "cache_salt": "tenant-b"}) == (0, ref)
        assert hits(path, body) == (0, ref)
        warm, out = hits(path, {**body, "cache_salt": "tenant-a"})
        assert warm > 0 and out == ref


def test_metrics_and_periodic_log(server, http):
    m = metrics(http)
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "num_preemptions_total", "num_requests_swapped",
                 "num_swapped_out_blocks_total", "num_swapped_in_blocks_total", "num_recomputed_tokens_total",
                 "prompt_tokens_total",
                 "generation_tokens_total", "time_to_first_token_seconds_count", "inter_token_latency_seconds_count",
                 "e2e_request_latency_seconds_count", "request_queue_time_seconds_count"):
        assert "pagedserve:" + name in m, name
    assert m["pagedserve:time_to_first_token_seconds_count"] > 0
    assert m["pagedserve:prompt_tokens_total"] > 0
    # The shared prefix of PROMPT (longer than a block) was served from the prefix cache.
    assert m["pagedserve:prefix_cache_hits_total"] > 0
    deadline = time.monotonic() + 30
    while "Avg generation throughput" not in server.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    line = next(x for x in server.log().splitlines() if "Avg generation throughput" in x)
    for part in ("Avg prompt throughput", "Running:", "Swapped:", "Waiting:", "KV cache usage:",
                 "Prefix cache hit rate:"):
        assert part in line


# ---- shutdown and startup -----------------------------------------------------------------------
def test_503_while_starting_and_stopping(tiny_llama):
    """In process: an app whose engine has not started (or is stopping) answers 503, OpenAI-shaped."""
    from pagedserve.config import EngineConfig
    from pagedserve.engine.async_llm import AsyncLLM
    from pagedserve.server.app import build_app
    from pagedserve.server.state import ServerState
    from pagedserve.server.metrics import PrometheusStatLogger

    state = ServerState(AsyncLLM(EngineConfig(model=tiny_llama.path)), ["tiny"], PrometheusStatLogger("tiny"))
    app = build_app(state)   # no lifespan under ASGITransport: the engine never starts

    async def get(path, method="GET"):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.request(method, path, json={"prompt": "x"})

    for path, method in (("/health", "GET"), ("/v1/completions", "POST"), ("/v1/models", "GET")):
        r = asyncio.run(get(path, method))
        assert r.status_code == 503 and "not ready" in r.json()["error"]["message"]
    assert asyncio.run(get("/version")).status_code == 200
    state.shutting_down = True
    r = asyncio.run(get("/v1/completions", "POST"))
    assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]


def test_unexpected_error_is_one_500_that_closes_the_connection(tiny_llama, caplog):
    """In process, with an injected fault: a failure nothing handles is logged once and answered
    500 in OpenAI's shape with Connection: close (not re-raised into a second traceback)."""
    from pagedserve.config import EngineConfig
    from pagedserve.engine.async_llm import AsyncLLM
    from pagedserve.server.app import build_app
    from pagedserve.server.state import ServerState
    from pagedserve.server.metrics import PrometheusStatLogger

    state = ServerState(AsyncLLM(EngineConfig(model=tiny_llama.path)), ["tiny"], PrometheusStatLogger("tiny"))

    def broken() -> str:
        raise RuntimeError("injected fault")
    state.metrics.render = broken

    async def get():
        transport = httpx.ASGITransport(app=build_app(state), raise_app_exceptions=True)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await c.get("/metrics")

    with caplog.at_level(logging.INFO):
        r = asyncio.run(get())
    assert r.status_code == 500 and r.headers["connection"] == "close"
    assert r.json()["error"]["type"] == "server_error" and "injected fault" in r.json()["error"]["message"]
    assert [rec.getMessage() for rec in caplog.records
            if rec.exc_info and rec.name.startswith("pagedserve")] == ["unexpected error serving GET /metrics"]


def test_sigterm_drains_answering_503_then_exits_zero(tiny_llama, tmp_path):
    """After SIGTERM the server keeps listening: new requests (and /health, GET or HEAD) get 503
    in OpenAI's shape while the requests in flight finish normally; then it exits 0. One request
    in flight is held open by its unfinished body, so the drain lasts as long as the test needs."""
    srv = launch_server(tiny_llama.path, tiny_server_args("--shutdown-timeout", "60"), tmp_path / "server.log")
    host, port = srv.url.removeprefix("http://").split(":")
    body = json.dumps({"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "ignore_eos": True}).encode()
    try:
        held = socket.create_connection((host, int(port)))
        held.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body[:10])
        stream = {"prompt": PROMPT, "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", srv.url + "/v1/completions", json=stream, timeout=60) as r:
            lines = r.iter_lines()
            first = [next(lines) for _ in range(2)]
            srv.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 30
            while srv.health() != 503 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert httpx.head(srv.url + "/health").status_code == 503
            refused = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1})
            assert refused.status_code == 503, refused.text
            err = refused.json()["error"]
            assert err["type"] == "service_unavailable" and "shutting down" in err["message"], err
            events = sse_events(first + list(lines))
        assert events[-1] == "[DONE]"
        assert events[-2]["choices"][0]["finish_reason"] == "length"      # finished, not aborted
        held.sendall(body[10:])                                            # the held request is answered too
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            chunk = held.recv(65536)
            assert chunk, reply
            reply += chunk
        held.close()
        assert reply.startswith(b"HTTP/1.1 200"), reply
        assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["choices"][0]["finish_reason"] == "length"
        assert srv.proc.wait(30) == 0, srv.log()[-3000:]
        assert "new requests get 503" in srv.log()
    finally:
        srv.stop()


def test_default_model_server(tmp_path):
    from pagedserve.models.loader import default_model_path
    try:
        default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    # The dequantized path: this question's first token is a near-tie ("The" 0.08 nats above "L")
    # that the native Q4_1 blocks' 8-bit activations flip (tests/test_quantized_models.py).
    srv = launch_server(None, ["--dtype", "float32", "--kv-cache-memory", str(256 * 1024**2), "--gguf-dequantize"],
                        tmp_path / "server.log")
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)
        name = "HuggingFaceTB/SmolLM2-135M-Instruct"
        assert c.models.list().data[0].id == name
        text = ""
        stream = c.chat.completions.create(model=name, temperature=0, max_tokens=30, stream=True,
                                           messages=[{"role": "user", "content": "What is the capital of France?"}])
        for chunk in stream:
            text += chunk.choices[0].delta.content or ""
            if "Paris" in text:
                stream.close()   # leave early: the rest is aborted
                break
        assert "Paris" in text
    finally:
        assert srv.stop() == 0


def test_sigterm_aborts_in_flight_requests_and_exits_zero(server):
    """Runs last on the module's server (started with --shutdown-timeout 0): a stream in flight
    gets an error event and [DONE], and the process exits 0. Slowed steps keep the stream running
    (400 tokens, at least 8 s) until the signal is handled."""
    body = {"prompt": f"{PROMPT} {SLOW_STEPS}", "max_tokens": 400, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as r:
        lines = r.iter_lines()
        first = [next(lines) for _ in range(4)]
        server.proc.send_signal(signal.SIGTERM)
        events = sse_events(first + list(lines))
    assert events[-1] == "[DONE]"
    assert "error" in events[-2] and "shutting down" in events[-2]["error"]["message"]
    assert server.proc.wait(30) == 0, server.log()[-3000:]
    assert "Shutting down" in server.log()
