"""SIGTERM with clients in flight (issue 34), on a real server subprocess: each client still
waiting is answered with an OpenAI-shaped 503 (not uvicorn's plain-text 500), grammar compiles
are cancelled, and the process exits 0 soon after --shutdown-timeout, although a compile and a
chat template render are stuck for 30 s (tests/fault_server.py's SLOW_COMPILE and SLOW_RENDER)."""
from __future__ import annotations

import signal
import threading
import time

import httpx

from pagedserve.server.launcher import launch_server
from tests.fault_server import SLOW_COMPILE, SLOW_RENDER, SLOW_STEPS
from tests.server_utils import PROMPT, sse_events, tiny_server_args

SHUTDOWN_TIMEOUT = 1
EXIT_BOUND = SHUTDOWN_TIMEOUT + 5   # the drain, 1 s of 503s, slack for a loaded machine (the stuck ones: 30 s)


def test_sigterm_answers_every_client_503_and_exits_in_time(tiny_llama, tmp_path):
    srv = launch_server(tiny_llama.path, tiny_server_args("--shutdown-timeout", str(SHUTDOWN_TIMEOUT)),
                        tmp_path / "server.log", module="tests.fault_server")
    results: dict[str, httpx.Response | list] = {}
    started = {name: threading.Event() for name in ("compile", "render", "stream")}

    def post(name: str, path: str, body: dict) -> None:
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            started[name].set()
            results[name] = http.post(path, json=body)

    def stream() -> None:
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            body = {"prompt": f"{SLOW_STEPS} {PROMPT}", "max_tokens": 400, "ignore_eos": True, "stream": True}
            with http.stream("POST", "/v1/completions", json=body) as r:
                lines = []
                for line in r.iter_lines():
                    lines.append(line)
                    started["stream"].set()
                results["stream"] = sse_events(lines)

    threads = [
        threading.Thread(target=post, args=("compile", "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "structured_outputs": {"grammar": f'root ::= "{SLOW_COMPILE}"'}})),
        threading.Thread(target=post, args=("render", "/v1/chat/completions", {
            "messages": [{"role": "user", "content": SLOW_RENDER}], "max_tokens": 4})),
        threading.Thread(target=stream)]
    try:
        # The stream first (its prompt is tokenized in the lane the stuck render will hold).
        threads[2].start()
        assert started["stream"].wait(60)
        for t in threads[:2]:
            t.start()
        for event in started.values():
            assert event.wait(60)
        time.sleep(0.5)   # the compile and the render are under way
        signalled = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        srv.proc.wait(60)
        exit_seconds = time.monotonic() - signalled
        for t in threads:
            t.join(60)
    finally:
        srv.stop()
    log = srv.log()
    assert srv.proc.returncode == 0, log[-3000:]
    assert exit_seconds < EXIT_BOUND, (exit_seconds, log[-3000:])
    for name in ("compile", "render"):
        r = results[name]
        assert r.status_code == 503, (name, r.status_code, r.text)
        err = r.json()["error"]
        assert err["type"] == "service_unavailable" and "shutting down" in err["message"], err
    events = results["stream"]
    assert events[-1] == "[DONE]" and events[-2]["error"]["type"] == "service_unavailable", events[-3:]
    assert "Traceback" not in log, log[-5000:]
