"""Bad input and limits on the real server (a subprocess on the tiny model).

The catalogue below is a table of malformed or hostile requests. Each must get
a 4xx with an OpenAI-shaped error ({"error": {"message", "type", "param",
"code"}}) that names the problem, leave nothing allocated, and never reach the
engine in a way that could fail a step (which would abort everyone's requests).
Afterwards the server still answers a normal request exactly as the offline
engine does. The limits: a request body over --max-request-body-bytes gets 413
(declared or chunked), and beyond --max-waiting-requests queued requests new
ones get 503 until the queue drains.
"""
from __future__ import annotations

import contextlib
import json
import socket
import time
from dataclasses import dataclass, field

import httpx
import pytest

from pagedserve import LLM, SamplingParams
from tests.fault_server import SLOW_STEPS
from tests.server_utils import API_KEY, KV_BLOCKS, PROMPT, api_server_args, metrics, served, sse_events, wait_idle

MAX_BODY = 64 * 1024
MAX_SEQS = 2
MAX_WAITING = 2


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    yield from served(tiny_llama.path, tmp_path_factory.mktemp("server"), api_server_args(
        "--max-num-seqs", str(MAX_SEQS), "--max-waiting-requests", str(MAX_WAITING),
        "--max-request-body-bytes", str(MAX_BODY)),
        module="tests.fault_server")   # for SLOW_STEPS: the catalogue meets no fault


@dataclass
class Bad:
    name: str
    path: str
    body: dict | bytes | None
    status: int
    param: str | None                  # the error's param: which field is wrong
    words: list[str] = field(default_factory=list)   # the message names the problem
    headers: dict | None = None
    method: str = "POST"


C, H = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]
CATALOGUE = [
    # The body itself
    Bad("not-json", C, b"{not json", 400, None, ["JSON"]),
    Bad("empty-body", C, b"", 400, None, ["JSON"]),
    Bad("body-is-a-list", C, b"[1, 2]", 400, None, ["object"]),
    Bad("bad-utf8", C, b'{"prompt": "\xff\xfe"}', 400, None, ["JSON", "unicode"]),
    Bad("lone-surrogate", C, b'{"prompt": "\\ud800"}', 400, None, ["JSON"]),
    Bad("deeply-nested", C, b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, None, ["JSON"]),
    Bad("oversized-body", C, {"prompt": "x" * (MAX_BODY + 1)}, 413, None, ["limit", str(MAX_BODY)]),
    Bad("nan-literal", C, b'{"prompt": "x", "temperature": NaN}', 400, "temperature", ["finite"]),
    Bad("infinite-number", C, b'{"prompt": "x", "top_p": 1e999}', 400, "top_p", ["finite"]),
    # Missing fields and wrong types
    Bad("missing-prompt", C, {"max_tokens": 3}, 400, "prompt", ["prompt"]),
    Bad("prompt-is-a-number", C, {"prompt": 5}, 400, "prompt"),
    Bad("prompt-mixed-list", C, {"prompt": [[1, 2], "x"]}, 400, "prompt"),
    Bad("max-tokens-string", C, {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    Bad("n-string", C, {"prompt": "x", "n": "two"}, 400, "n"),
    Bad("n-float", C, {"prompt": "x", "n": 1.5}, 400, "n"),
    Bad("stop-wrong-type", C, {"prompt": "x", "stop": 5}, 400, "stop"),
    Bad("stream-options-wrong-type", C, {"prompt": "x", "stream_options": "yes"}, 400, "stream_options"),
    Bad("messages-is-a-string", H, {"messages": "hi"}, 400, "messages"),
    # Strict types, as OpenAI's API has them: nothing is coerced
    Bad("max-tokens-bool", C, {"prompt": "x", "max_tokens": True}, 400, "max_tokens", ["integer"]),
    Bad("max-tokens-float", C, {"prompt": "x", "max_tokens": 16.0}, 400, "max_tokens", ["integer"]),
    Bad("n-numeric-string", C, {"prompt": "x", "n": "2"}, 400, "n", ["integer"]),
    Bad("chat-n-numeric-string", H, {"messages": USER, "n": "2"}, 400, "n", ["integer"]),
    Bad("logprobs-bool", C, {"prompt": "x", "logprobs": True}, 400, "logprobs", ["integer"]),
    Bad("chat-logprobs-int", H, {"messages": USER, "logprobs": 1}, 400, "logprobs", ["boolean"]),
    Bad("top-k-numeric-string", C, {"prompt": "x", "top_k": "3"}, 400, "top_k", ["integer"]),
    Bad("seed-numeric-string", C, {"prompt": "x", "seed": "7"}, 400, "seed", ["integer"]),
    Bad("min-tokens-bool", C, {"prompt": "x", "min_tokens": False}, 400, "min_tokens", ["integer"]),
    Bad("chat-max-completion-tokens-string", H, {"messages": USER, "max_completion_tokens": "5"}, 400,
        "max_completion_tokens", ["integer"]),
    Bad("chat-top-logprobs-bool", H, {"messages": USER, "logprobs": True, "top_logprobs": True}, 400,
        "top_logprobs", ["integer"]),
    Bad("temperature-numeric-string", C, {"prompt": "x", "temperature": "0.5"}, 400, "temperature", ["number"]),
    Bad("top-p-bool", C, {"prompt": "x", "top_p": True}, 400, "top_p", ["number"]),
    Bad("chat-presence-penalty-string", H, {"messages": USER, "presence_penalty": "1"}, 400, "presence_penalty"),
    Bad("logit-bias-value-string", C, {"prompt": "x", "logit_bias": {"5": "1"}}, 400, "logit_bias"),
    Bad("stream-int", C, {"prompt": "x", "stream": 1}, 400, "stream", ["boolean"]),
    Bad("echo-string", C, {"prompt": "x", "echo": "true"}, 400, "echo", ["boolean"]),
    Bad("ignore-eos-int", C, {"prompt": "x", "ignore_eos": 0}, 400, "ignore_eos", ["boolean"]),
    Bad("use-beam-search-string", C, {"prompt": "x", "use_beam_search": "yes"}, 400, "use_beam_search"),
    Bad("include-usage-int", C, {"prompt": "x", "stream": True, "stream_options": {"include_usage": 1}}, 400,
        "stream_options"),
    Bad("prompt-list-of-bools", C, {"prompt": [True, False]}, 400, "prompt"),
    Bad("stop-token-ids-bools", C, {"prompt": "x", "stop_token_ids": [True]}, 400, "stop_token_ids"),
    Bad("chat-content-number", H, {"messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    Bad("detokenize-bools", "/detokenize", {"tokens": [True]}, 400, "tokens"),
    Bad("message-without-role", H, {"messages": [{"content": "hi"}]}, 400, "messages"),
    # Values out of range
    Bad("max-tokens-negative", C, {"prompt": "x", "max_tokens": -5}, 400, "max_tokens", ["max_tokens", "-5"]),
    Bad("max-tokens-zero", C, {"prompt": "x", "max_tokens": 0}, 400, "max_tokens", ["max_tokens"]),
    Bad("max-tokens-huge", C, {"prompt": "x", "max_tokens": 10**12}, 400, "max_tokens", ["512"]),
    Bad("max-tokens-beyond-int64", C, {"prompt": "x", "max_tokens": 10**30}, 400, "max_tokens"),
    Bad("temperature-negative", C, {"prompt": "x", "temperature": -1}, 400, "temperature", ["temperature"]),
    Bad("top-p-zero", C, {"prompt": "x", "top_p": 0}, 400, "top_p", ["top_p"]),
    Bad("top-p-above-one", C, {"prompt": "x", "top_p": 7}, 400, "top_p", ["top_p", "7"]),
    Bad("top-k-negative", C, {"prompt": "x", "top_k": -5}, 400, "top_k", ["top_k"]),
    Bad("top-k-beyond-int64", C, {"prompt": "x", "top_k": 10**30}, 400, "top_k"),
    Bad("min-p-above-one", C, {"prompt": "x", "min_p": 2}, 400, "min_p", ["min_p"]),
    Bad("presence-penalty-5", C, {"prompt": "x", "presence_penalty": 5}, 400, "presence_penalty", ["[-2, 2]"]),
    Bad("repetition-penalty-0", C, {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    Bad("n-zero", C, {"prompt": "x", "n": 0}, 400, "n", ["n must"]),
    Bad("n-negative", C, {"prompt": "x", "n": -1}, 400, "n", ["n must"]),
    Bad("chat-n-negative", H, {"messages": USER, "n": -1}, 400, "n", ["n must"]),
    Bad("beam-search-n-negative", C, {"prompt": "x", "use_beam_search": True, "n": -2}, 400, "n", ["n must"]),
    Bad("best-of-negative", C, {"prompt": "x", "best_of": -1}, 400, "best_of", ["best_of"]),
    Bad("n-huge", C, {"prompt": "x", "n": 10**6}, 400, "n", ["--max-num-seqs"]),
    Bad("best-of-over-max-num-seqs", C, {"prompt": "x", "n": 1, "best_of": 3, "temperature": 1}, 400, "best_of",
        ["--max-num-seqs"]),
    Bad("best-of-below-n", C, {"prompt": "x", "n": 2, "best_of": 1}, 400, "best_of", ["best_of"]),
    Bad("best-of-with-stream", C, {"prompt": "x", "n": 1, "best_of": 2, "stream": True}, 400, "best_of",
        ["stream"]),
    Bad("logprobs-50", C, {"prompt": "x", "logprobs": 50}, 400, "logprobs", ["logprobs", "20"]),
    Bad("logprobs-negative", C, {"prompt": "x", "logprobs": -1}, 400, "logprobs", ["logprobs"]),
    Bad("top-logprobs-21", H, {"messages": USER, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs",
        ["20"]),
    Bad("top-logprobs-without-logprobs", H, {"messages": USER, "top_logprobs": 2}, 400, "top_logprobs",
        ["logprobs"]),
    Bad("min-tokens-negative", C, {"prompt": "x", "min_tokens": -1}, 400, "min_tokens", ["min_tokens"]),
    Bad("min-tokens-over-max", C, {"prompt": "x", "max_tokens": 2, "min_tokens": 5}, 400, "min_tokens"),
    Bad("seed-beyond-int64", C, {"prompt": "x", "seed": 2**70}, 400, "seed"),
    Bad("stop-empty-string", C, {"prompt": "x", "stop": [""]}, 400, "stop", ["stop"]),
    Bad("logit-bias-out-of-vocabulary", C, {"prompt": "x", "logit_bias": {"999999": 5}}, 400, "logit_bias",
        ["vocabulary"]),
    Bad("logit-bias-key-not-an-id", C, {"prompt": "x", "logit_bias": {"abc": 5}}, 400, "logit_bias", ["abc"]),
    Bad("logit-bias-key-underscore", C, {"prompt": "x", "logit_bias": {"1_0": 5}}, 400, "logit_bias", ["1_0"]),
    Bad("logit-bias-key-spaces", C, {"prompt": "x", "logit_bias": {" 10 ": 5}}, 400, "logit_bias", ["' 10 '"]),
    Bad("logit-bias-key-arabic-digits", C, {"prompt": "x", "logit_bias": {"\u0661\u0660": 5}}, 400, "logit_bias",
        ["\u0661\u0660"]),
    Bad("logit-bias-key-plus-sign", C, {"prompt": "x", "logit_bias": {"+5": 5}}, 400, "logit_bias", ["+5"]),
    Bad("cache-salt-empty", C, {"prompt": "x", "cache_salt": ""}, 400, "cache_salt"),
    Bad("chat-cache-salt-number", H, {"messages": USER, "cache_salt": 5}, 400, "cache_salt"),
    Bad("logit-bias-value-1000", C, {"prompt": "x", "logit_bias": {"5": 1000}}, 400, "logit_bias", ["100"]),
    Bad("stop-token-ids-out-of-vocabulary", C, {"prompt": "x", "min_tokens": 1, "stop_token_ids": [10**7]}, 400,
        "stop_token_ids", ["vocabulary"]),
    Bad("beam-search-with-stop", C, {"prompt": "x", "use_beam_search": True, "n": 2, "stop": "a"}, 400, "stop"),
    # These two killed the engine thread (OverflowError / ZeroDivisionError in beam scoring).
    Bad("beam-length-penalty-1e9", C, {"prompt": "hi", "max_tokens": 2, "n": 2, "use_beam_search": True,
                                       "length_penalty": 1e9}, 400, "length_penalty", ["length_penalty", "100"]),
    Bad("beam-length-penalty-minus-1e9", C, {"prompt": "hi", "max_tokens": 2, "n": 2, "use_beam_search": True,
                                             "length_penalty": -1e9}, 400, "length_penalty", ["length_penalty"]),
    # Prompts
    Bad("prompt-longer-than-context", C, {"prompt": list(range(5, 605))}, 400, "prompt", ["600", "512"]),
    Bad("prompt-plus-max-tokens-over-context", C, {"prompt": list(range(5, 505)), "max_tokens": 100}, 400,
        "max_tokens", ["500", "100", "512"]),
    Bad("prompt-empty-list", C, {"prompt": []}, 400, "prompt", ["empty"]),
    Bad("prompt-empty-string", C, {"prompt": ""}, 400, "prompt", ["empty"]),
    Bad("prompt-token-out-of-vocabulary", C, {"prompt": [1, 10**7]}, 400, "prompt", ["vocabulary"]),
    Bad("prompt-token-negative", C, {"prompt": [1, -3]}, 400, "prompt", ["vocabulary"]),
    Bad("more-prompts-than-the-queue", C, {"prompt": ["a", "b", "c"]}, 400, "prompt", ["--max-waiting-requests"]),
    Bad("suffix", C, {"prompt": "x", "suffix": "y"}, 400, "suffix"),
    Bad("chat-empty-messages", H, {"messages": []}, 400, "messages", ["empty"]),
    Bad("chat-unknown-role", H, {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages", ["role"]),
    Bad("chat-image-content", H, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
        "messages", ["image_url"]),
    Bad("chat-prompt-longer-than-context", H, {"messages": [{"role": "user", "content": "x " * 600}]}, 400,
        "messages", ["512"]),
    Bad("chat-tools", H, {"messages": USER, "tools": [{"type": "function"}]}, 400, "tools"),
    Bad("chat-invalid-json-schema", H, {"messages": USER, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "required": "a"}}}}, 400,
        "response_format", ["schema"]),
    Bad("completion-bad-regex", C, {"prompt": "x", "guided_regex": "a{2"}, 400, "guided_regex", ["regex"]),
    Bad("chat-empty-choice", H, {"messages": USER, "structured_outputs": {"choice": []}}, 400, "structured_outputs"),
    Bad("chat-auto-tools-without-parser", H, {"messages": USER, "tools": [
        {"type": "function", "function": {"name": "f"}}]}, 400, "tool_choice", ["--enable-auto-tool-choice"]),
    Bad("chat-max-completion-tokens-zero", H, {"messages": USER, "max_completion_tokens": 0}, 400, "max_tokens"),
    # Model, key, route
    Bad("unknown-model", C, {"prompt": "x", "model": "gpt-4"}, 404, "model", ["gpt-4"]),
    Bad("wrong-api-key", C, {"prompt": "x"}, 401, None, ["API key"], headers={"Authorization": "Bearer wrong"}),
    Bad("no-api-key", C, {"prompt": "x"}, 401, None, ["API key"], headers={"Authorization": ""}),
    Bad("unknown-route", "/v1/nope", {}, 404, None, ["/v1/nope"]),
    Bad("get-on-a-post-route", C, None, 405, None, [], method="GET"),
    Bad("detokenize-out-of-vocabulary", "/detokenize", {"tokens": [10**7]}, 400, "tokens", ["vocabulary"]),
]


def send(http: httpx.Client, bad: Bad) -> httpx.Response:
    body = bad.body if isinstance(bad.body, bytes) or bad.body is None else json.dumps(bad.body).encode()
    return http.request(bad.method, bad.path, content=body, headers=bad.headers)


def test_catalogue_is_big_enough():
    assert len(CATALOGUE) >= 30 and len({b.name for b in CATALOGUE}) == len(CATALOGUE)


@pytest.mark.parametrize("bad", CATALOGUE, ids=[b.name for b in CATALOGUE])
def test_bad_request_gets_a_clear_openai_error(http, bad):
    r = send(http, bad)
    assert r.status_code == bad.status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["param"] == bad.param, err
    for word in bad.words:
        assert word in err["message"], err


def test_a_body_cut_short_is_a_client_disconnect_not_a_server_error(server):
    """A client declares Content-Length: 1000, sends 30 bytes and leaves: one log line says so;
    no 500, no traceback."""
    host, port = server.url.removeprefix("http://").split(":")
    start = len(server.log())
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: 1000\r\n\r\n"
                  + b'{"prompt": "cut short", "max_t')
    deadline = time.monotonic() + 30
    while "client disconnected" not in server.log()[start:] and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)   # anything else it would log comes with it
    new = server.log()[start:]
    assert new.count("client disconnected before sending the whole request body: POST /v1/completions") == 1, new
    assert "Traceback" not in new and "ERROR" not in new and "500" not in new, new


def test_server_is_unharmed_by_the_catalogue(server, http, tiny_llama):
    """Runs after the catalogue: nothing failed inside the server, nothing is held, and a normal
    request is answered exactly as the offline engine answers it."""
    for bad in CATALOGUE:   # once more, back to back
        assert send(http, bad).status_code == bad.status
    m = wait_idle(http)
    assert m["pagedserve:kv_cache_usage_perc"] == 0 and m["pagedserve:num_requests_waiting"] == 0
    assert "internal error" not in server.log() and "Traceback" not in server.log(), server.log()[-3000:]
    ref = LLM(tiny_llama.path, dtype="float32", num_gpu_blocks_override=KV_BLOCKS).generate(
        PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref.text


# ---- limits -------------------------------------------------------------------------------------
def test_body_limit_applies_to_chunked_bodies_too(http):
    def chunks():   # no Content-Length: the server counts as it reads
        yield b'{"prompt": "'
        for _ in range(MAX_BODY // 1024 + 1):
            yield b"x" * 1024
        yield b'"}'
    r = http.post("/v1/completions", content=chunks())
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]
    just_under = {"prompt": PROMPT, "max_tokens": 1, "padding": "x" * (MAX_BODY - 200)}
    assert http.post("/v1/completions", json=just_under).status_code == 200


def test_queue_limit_gives_503_until_it_drains(server, http):
    """max-num-seqs 2 run, max-waiting-requests 2 wait; the next request gets 503 at once.
    Slowed steps hold the running two for 400 x 20 ms: they cannot finish before the checks."""
    body = {"prompt": f"{PROMPT} {SLOW_STEPS}", "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
    streams, opened = [], []
    try:
        for i in range(MAX_SEQS + MAX_WAITING):
            cm = http.stream("POST", "/v1/completions", json=body)
            r = cm.__enter__()
            opened.append(cm)
            assert r.status_code == 200          # headers come once the engine has the request
            lines = r.iter_lines()
            if i < MAX_SEQS:
                next(line for line in lines if line.startswith("data: "))   # it is running
            streams.append(lines)
        m = metrics(http)
        assert (m["pagedserve:num_requests_running"], m["pagedserve:num_requests_waiting"]) == (MAX_SEQS, MAX_WAITING)
        for _ in range(3):
            r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
            assert r.status_code == 503, r.text
            err = r.json()["error"]
            assert err["type"] == "service_unavailable" and "--max-waiting-requests" in err["message"], err
            assert r.headers.get("retry-after") == "1", r.headers    # the client's back-off (issue 51)
        # Bad input is answered as such whatever the queue's state, never "retry later" first (issue 51).
        for bad, param in [({"prompt": [5] * 2000}, "prompt"), ({"prompt": "x", "n": MAX_SEQS + 1}, "n")]:
            r = http.post("/v1/completions", json={**bad, "max_tokens": 1})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    finally:
        for cm in opened:   # disconnect: the server aborts them
            cm.__exit__(None, None, None)
    m = wait_idle(http, timeout=30)
    assert m["pagedserve:kv_cache_usage_perc"] == 0 and m["pagedserve:num_requests_waiting"] == 0
    assert http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200


# A server whose KV cache (16 blocks of 16: 256 tokens) is smaller than the model's context (512):
# a request can fit the context and still never fit the cache.
SMALL_KV_BLOCKS = 16


@pytest.fixture(scope="module")
def small_kv_server(tiny_llama, tmp_path_factory):
    yield from served(tiny_llama.path, tmp_path_factory.mktemp("small-kv"), api_server_args(
        "--max-num-seqs", "1", "--max-waiting-requests", "1", kv_blocks=SMALL_KV_BLOCKS),
        module="tests.fault_server")


def test_a_full_queue_answers_bad_text_prompts_as_bad(small_kv_server, tiny_llama):
    """One request runs (slowed), one waits: the queue is full. A text prompt the engine would
    refuse gets its 400 all the same (over-long: tokens past the context within the characters'
    bound; one whose max_tokens can never fit the KV cache), a valid one 503; the running
    client's stream goes on to the offline engine's greedy text (issue 51)."""
    greedy = {"temperature": 0, "ignore_eos": True}
    running = {"prompt": f"{PROMPT} {SLOW_STEPS}", "max_tokens": 120, "stream": True, **greedy}
    ref = LLM(tiny_llama.path, dtype="float32", num_gpu_blocks_override=SMALL_KV_BLOCKS).generate(
        running["prompt"], SamplingParams(max_tokens=120, **greedy), use_tqdm=False)[0].outputs[0].text
    with httpx.Client(base_url=small_kv_server.url, headers={"Authorization": f"Bearer {API_KEY}"},
                      timeout=60) as http:
        with contextlib.ExitStack() as streams:
            r = streams.enter_context(http.stream("POST", "/v1/completions", json=running))
            assert r.status_code == 200
            lines = r.iter_lines()
            first = [next(line for line in lines if line.startswith("data: "))]   # it runs: the next one waits
            waiting = streams.enter_context(http.stream("POST", "/v1/completions", json={**running, "max_tokens": 2}))
            assert waiting.status_code == 200   # the engine has it
            m = metrics(http)
            assert (m["pagedserve:num_requests_running"], m["pagedserve:num_requests_waiting"]) == (1, 1)
            for body, words in [({"prompt": " x" * 600, "max_tokens": 1}, "maximum context length"),
                                ({"prompt": PROMPT, "max_tokens": 400}, "never fit in the KV cache")]:
                bad = http.post("/v1/completions", json=body)
                assert bad.status_code == 400, bad.text
                err = bad.json()["error"]
                assert err["param"] == "prompt" and words in err["message"], err
            full = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1})
            assert full.status_code == 503 and "--max-waiting-requests" in full.json()["error"]["message"], full.text
            events = sse_events(first + list(lines))
    text = "".join(e["choices"][0]["text"] for e in events if isinstance(e, dict) and e.get("choices"))
    assert text == ref and events[-1] == "[DONE]"
