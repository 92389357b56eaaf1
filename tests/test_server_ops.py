"""Operations basics of the server (issue 23): CORS, vLLM's metric names, request logs, unknown
fields logged once; the Dockerfile and compose example parse; the LICENSE is there."""
from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
import pytest

from tests.server_utils import api_server_args, served

ROOT = Path(__file__).resolve().parents[1]
ORIGIN = "http://app.example"


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    yield from served(tiny_llama.path, tmp_path_factory.mktemp("server_ops"),
                      api_server_args("--metrics-prefix", "vllm:", "--allowed-origins", ORIGIN))


def wait_for_log(server, pattern: str, timeout: float = 60.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.findall(pattern, server.log())
        if found:
            return found
        time.sleep(0.1)
    raise AssertionError(f"{pattern!r} not in the log:\n{server.log()[-3000:]}")


def test_cors_preflight_and_headers(server, http):
    # A browser's preflight carries no API key; it is answered, for the allowed origin only.
    pre = httpx.options(server.url + "/v1/completions", headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in pre.headers["access-control-allow-methods"]
    other = httpx.options(server.url + "/v1/completions", headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    r = http.get("/v1/models", headers={"Origin": ORIGIN})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN


def test_vllm_metric_names(server, http):
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0,
                                          "ignore_eos": True})
    assert r.status_code == 200
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        text = http.get("/metrics").text
        m = re.search(r'^vllm:time_per_output_token_seconds_count\{model_name="tiny"\} (\S+)', text, re.M)
        if m and float(m.group(1)) >= 3:
            break
        time.sleep(0.2)
    assert m and float(m.group(1)) >= 3, text    # 4 tokens: 3 intervals at least
    assert "vllm:num_requests_running" in text and "vllm:kv_cache_usage_perc" in text
    assert "pagedserve:" not in text


def test_request_logs_and_unknown_fields_logged_once(server, http):
    for _ in range(2):
        r = http.post("/v1/completions", json={"model": "tiny", "prompt": "Hi there", "max_tokens": 3,
                                              "temperature": 0, "no_such_field": 1})
        assert r.status_code == 200
    ignored = wait_for_log(server, r"ignoring request field\(s\) pagedserve does not support: no_such_field")
    assert len(ignored) == 1
    wait_for_log(server, r"request cmpl-\w+: 1 prompt\(s\) of \d+ tokens, n=1, temperature=0.0")
    wait_for_log(server, r"request cmpl-\w+ finished: (length|stop), \d+ completion tokens")
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "Hi", "temperature": -1})
    assert r.status_code == 400
    wait_for_log(server, r"refused POST /v1/completions: 400 temperature must be >= 0.* \(param temperature\)")
    assert httpx.get(server.url + "/v1/models").status_code == 401
    wait_for_log(server, r"refused GET /v1/models: 401")


def test_dockerfile_and_compose_example_parse():
    lines = [line for line in (ROOT / "Dockerfile").read_text().replace("\\\n", " ").splitlines()
             if line.strip() and not line.lstrip().startswith("#")]
    instructions = [line.split()[0].upper() for line in lines]
    known = {"FROM", "RUN", "COPY", "ADD", "ENV", "ARG", "WORKDIR", "EXPOSE", "USER", "HEALTHCHECK", "CMD",
             "ENTRYPOINT", "LABEL"}
    assert instructions[0] == "FROM" and set(instructions) <= known, instructions
    text = " ".join(lines)
    assert "scripts/setup.sh" in text or "pip install" in text
    assert "--host" in text and "0.0.0.0" in text and "/health" in text and "EXPOSE 8000" in text
    import yaml
    compose = yaml.safe_load((ROOT / "examples" / "compose.yaml").read_text())
    service = next(iter(compose["services"].values()))
    assert "8000:8000" in [str(p) for p in service["ports"]] and "healthcheck" in service


def test_license_is_apache_2():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text


def test_chat_continue_final_message_and_template_kwargs(server, http, tiny_llama):
    from pagedserve.engine.chat import render_chat
    conv = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour is"}]
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": conv, "max_tokens": 2,
                                               "continue_final_message": True, "add_generation_prompt": False,
                                               "chat_template_kwargs": {"unused_variable": 1}})
    assert r.status_code == 200, r.text
    expected = render_chat(tiny_llama.tokenizer, conv, False, continue_final_message=True)
    assert r.json()["usage"]["prompt_tokens"] == len(expected)
    assert len(expected) < len(render_chat(tiny_llama.tokenizer, conv, False))   # the turn is left open
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": conv,
                                               "chat_template_kwargs": {"tokenize": False}})
    assert r.status_code == 400 and "tokenize" in r.json()["error"]["message"]
