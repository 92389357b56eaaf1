"""Large inputs on the real server (a subprocess on the tiny model): what can be refused
without tokenizing is refused first, and tokenizing and chat templating run off the event
loop, so one client's huge request never stalls /health or another client's stream.

"Not blocked" is counted, not timed: while the large prompts that are tokenized (seconds of
work on the prompt thread) are in flight, /health keeps answering: a poller gets several
answers in that time (tokenizing on the event loop froze it, and every stream, for the whole
tokenization: one answer before, one after). A loaded machine makes the tokenization longer,
so the count only grows.
"""
from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from pagedserve import LLM, SamplingParams
from tests.server_utils import KV_BLOCKS, PROMPT, served, sse_events, tiny_server_args, wait_idle

MAX_WAITING = 1024
STALL_SLACK = 0.5     # seconds a stream's largest gap may grow while the stalling bodies are refused
TEN_MB = "Paged attention stores keys and values in fixed-size blocks. " * 170_000   # 10.5 MB
USER = "user"


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    yield from served(tiny_llama.path, tmp_path_factory.mktemp("server"),
                      tiny_server_args("--max-waiting-requests", str(MAX_WAITING)))


def large_requests(tiny_llama) -> list[tuple[str, str, dict, str, str]]:
    """(name, path, body, the error's param, a word of its message): each is refused with a 400."""
    longest = max(len(t) for t in tiny_llama.tokenizer.get_vocab())
    fits_in_chars = TEN_MB[:512 * longest]   # may fit by its length, is too long once tokenized
    return [
        ("10-MB-prompt", "/v1/completions", {"prompt": TEN_MB, "max_tokens": 1}, "prompt", "characters"),
        ("250k-prompts", "/v1/completions", {"prompt": ["x"] * 250_000, "max_tokens": 1}, "prompt",
         "--max-waiting-requests"),
        ("1M-token-ids", "/v1/completions", {"prompt": [5] * 1_000_000, "max_tokens": 1}, "prompt", "512"),
        ("10-MB-chat", "/v1/chat/completions", {"messages": [{"role": USER, "content": TEN_MB}]}, "messages",
         "characters"),
        ("10-MB-tokenize", "/tokenize", {"prompt": TEN_MB}, "prompt", "characters"),
        # Within the cheap limits, so all of it is tokenized (seconds of work) before the 400. As many
        # prompts as the queue's bound: another client's request may be waiting then, and the queue is
        # full; each prompt's length is checked before the queue's room, so it is a 400 all the same.
        ("1024-long-prompts", "/v1/completions", {"prompt": [fits_in_chars] * MAX_WAITING, "max_tokens": 1},
         "prompt", "512"),
    ]


def test_large_inputs_are_refused_with_clear_errors(server, tiny_llama):
    with httpx.Client(base_url=server.url, timeout=120) as http:
        for name, path, body, param, word in large_requests(tiny_llama):
            r = http.post(path, json=body)
            assert r.status_code == 400, (name, r.text[:500])
            err = r.json()["error"]
            assert err["param"] == param and word in err["message"], (name, err)
        assert wait_idle(http)["pagedserve:kv_cache_usage_perc"] == 0


def test_large_requests_do_not_stall_other_clients(server, tiny_llama):
    ids = tiny_llama.tokenizer.encode(PROMPT)
    ref = LLM(tiny_llama.path, dtype="float32", num_gpu_blocks_override=KV_BLOCKS).generate(
        {"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=480, ignore_eos=True),
        use_tqdm=False)[0].outputs[0].text
    requests = large_requests(tiny_llama)
    done = threading.Event()
    statuses, health = [], []

    health_during: dict[str, int] = {}   # /health answers while each large request was in flight

    def send_large():
        with httpx.Client(base_url=server.url, timeout=120) as http:
            for name, path, body, _, _ in requests:
                before = len(health)
                statuses.append(http.post(path, json=body).status_code)
                health_during[name] = len(health) - before
        done.set()

    def poll_health():
        with httpx.Client(base_url=server.url, timeout=120) as http:
            while not done.is_set():
                health.append(http.get("/health").status_code)
                time.sleep(0.05)

    threads = [threading.Thread(target=send_large), threading.Thread(target=poll_health)]
    texts = []
    with httpx.Client(base_url=server.url, timeout=120) as http:
        # Streams one after another (token-id prompts: nothing to tokenize) until the large
        # requests are done.
        body = {"prompt": ids, "max_tokens": 480, "temperature": 0, "ignore_eos": True, "stream": True}
        while not done.is_set():
            with http.stream("POST", "/v1/completions", json=body) as r:
                lines = []
                for line in r.iter_lines():
                    lines.append(line)
                    if len(lines) == 3 and not threads[0].is_alive() and not done.is_set():
                        for t in threads:
                            t.start()
            events = sse_events(lines)
            texts.append("".join(e["choices"][0]["text"] for e in events if isinstance(e, dict)))
    for t in threads:
        t.join()
    assert health_during["1024-long-prompts"] >= 3, health_during
    assert health and set(health) == {200}
    assert statuses == [400] * len(requests)
    assert texts and all(text == ref for text in texts)


def stalling_bodies() -> list[tuple[str, str, bytes, str]]:
    """(name, path, body, the error's param): issue 51's bodies that held the event loop (and so
    every stream) for 5-10 s, each just under the 16 MiB body limit, each refused before parsing."""
    item = {"role": "user", "content": "x"}
    dumps = lambda d: json.dumps(d, separators=(",", ":")).encode()   # noqa: E731
    return [("/v1/responses with 500k items", "/v1/responses", dumps({"input": [item] * 500_000}), "input"),
            ("/tokenize with 500k messages", "/tokenize", dumps({"messages": [item] * 500_000}), "messages"),
            ("/detokenize of 7M ids", "/detokenize", dumps({"tokens": [1] * 7_000_000}), "tokens")]


def _stall(server, ids, bodies) -> tuple[float, float]:
    """A stream's largest gap between two chunks before the bodies are sent, and while they are
    sent and refused (streams one after another until they are all answered)."""
    arrivals: list[float] = []
    window: list[float] = []        # when the bodies were sent: [start, end]
    answers = []
    started = threading.Event()

    def send_bodies():
        started.wait()
        time.sleep(1.0)             # a second of the stream before them
        with httpx.Client(base_url=server.url, timeout=120) as http:
            window.append(time.monotonic())
            for name, path, body, param in bodies:
                r = http.post(path, content=body, headers={"Content-Type": "application/json"})
                answers.append((name, r.status_code, r.json()["error"].get("param") if r.status_code == 400 else r.text))
            window.append(time.monotonic())

    sender = threading.Thread(target=send_bodies)
    sender.start()
    body = {"prompt": ids, "max_tokens": 480, "temperature": 0, "ignore_eos": True, "stream": True}
    gaps: list[tuple[float, float]] = []     # (gap, when the later chunk came), within each stream
    with httpx.Client(base_url=server.url, timeout=120) as http:
        while not (len(window) == 2 and arrivals and arrivals[-1] > window[1] + 0.5):   # streams in a row
            arrivals.clear()
            with http.stream("POST", "/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        arrivals.append(time.monotonic())
                        started.set()
                        if len(arrivals) > 1:
                            gaps.append((arrivals[-1] - arrivals[-2], arrivals[-1]))
    sender.join()
    assert answers == [(name, 400, param) for name, _, _, param in bodies], answers
    return (max(g for g, at in gaps if at < window[0]),
            max(g for g, at in gaps if window[0] <= at <= window[1] + 0.2))


def test_no_body_stalls_another_clients_stream(server, tiny_llama):
    """A stream's largest gap while the bodies are sent and refused, against its largest gap
    before them: at most STALL_SLACK more (issue 51: 5.6-10.4 s). Receiving 48 MB competes for
    the CPU with the stream (here: about 50 ms more), and on a machine shared with other work a
    gap can grow by itself: the slack is generous and the best of three tries counts (a stall
    the bodies cause shows in every try)."""
    bodies = stalling_bodies()
    assert all(len(body) < 16 * 1024**2 for _, _, body, _ in bodies)
    ids = tiny_llama.tokenizer.encode(PROMPT)
    tries = []
    for _ in range(3):
        before, during = _stall(server, ids, bodies)
        tries.append((round(before, 3), round(during, 3)))
        if during <= before + STALL_SLACK:
            break
    assert min(during - before for before, during in tries) <= STALL_SLACK, tries


def test_slow_readers_do_not_keep_kv_blocks_after_generation(server, tiny_llama):
    """Clients that read their streams a few bytes a second: the engine finishes their requests
    and frees their blocks at its own pace, whatever the readers' (issue 51: held 20 s and more)."""
    import socket
    from urllib.parse import urlsplit

    from tests.server_utils import metrics
    url = urlsplit(server.url)
    ids = tiny_llama.tokenizer.encode(PROMPT)
    payload = json.dumps({"prompt": ids, "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True,
                          "logprobs": 5}).encode()
    socks = []
    for _ in range(4):
        s = socket.create_connection((url.hostname, url.port))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)     # a small window: the server's sends fill it
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
        socks.append(s)
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            deadline = time.monotonic() + 30
            m = metrics(http)
            while time.monotonic() < deadline:
                for s in socks:
                    s.recv(4)                                       # 4 bytes now and then
                m = metrics(http)
                if m["pagedserve:num_requests_running"] == 0 and m["pagedserve:kv_cache_usage_perc"] == 0:
                    break
                time.sleep(0.5)
            assert m["pagedserve:num_requests_running"] == 0 and m["pagedserve:kv_cache_usage_perc"] == 0, m
            unread = sum(len(s.recv(1 << 20, socket.MSG_DONTWAIT | socket.MSG_PEEK)) for s in socks)
            assert unread > 0, "the readers had read everything already: not slow enough to test anything"
    finally:
        for s in socks:
            s.close()


def test_slow_readers_do_not_grow_the_servers_memory_with_their_unread_output(server, tiny_llama):
    """Streams whose clients read nothing: the server's socket buffers fill and each stream's
    outputs wait for the reader. Waiting outputs are cumulative, so only the newest of each request
    is kept (engine/async_llm.py RequestStream): what a stalled reader pins is its output once,
    not one copy of it per step (before: 16 streams of 440 tokens grew the server by ~40 MB, the
    copies' sum, quadratic in the length). Meanwhile /health answers and the blocks are freed."""
    import socket
    from urllib.parse import urlsplit

    from tests.server_utils import metrics, rss_bytes
    url = urlsplit(server.url)
    ids = tiny_llama.tokenizer.encode(PROMPT)
    payload = json.dumps({"prompt": ids, "max_tokens": 512 - len(ids) - 8, "temperature": 0, "ignore_eos": True,
                          "stream": True, "logprobs": 2}).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    with httpx.Client(base_url=server.url, timeout=60) as http:
        wait_idle(http)
        before = rss_bytes(server.proc.pid)
        socks = []
        try:
            for _ in range(16):
                s = socket.create_connection((url.hostname, url.port))
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                s.sendall(request)
                socks.append(s)
            deadline, checks, answers = time.monotonic() + 120, 0, 0
            while time.monotonic() < deadline:
                checks += 1
                answers += http.get("/health").status_code == 200
                m = metrics(http)
                if m["pagedserve:num_requests_running"] == 0 and m["pagedserve:num_requests_waiting"] == 0 \
                        and m["pagedserve:kv_cache_usage_perc"] == 0:
                    break
                time.sleep(0.2)
            assert m["pagedserve:kv_cache_usage_perc"] == 0, m
            # the event loop kept answering (how many checks fit depends on the machine's speed)
            assert answers == checks >= 1
            assert http.get("/health").status_code == 200
            grown = rss_bytes(server.proc.pid) - before
            unread = sum(len(s.recv(1 << 20, socket.MSG_DONTWAIT | socket.MSG_PEEK)) for s in socks)
            assert unread > 0
            assert grown < 16 * 1024**2, f"the server grew by {grown / 1024**2:.1f} MB for 16 unread streams"
        finally:
            for s in socks:
                s.close()
