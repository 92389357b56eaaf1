"""Helpers shared by the tests that run the server as a subprocess on the tiny model."""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

API_KEY = "test-key"
KV_BLOCKS = 256
# The tiny model's KV bytes per 16-token block in float32: 2 (K, V) * 2 layers * 16 * 2 heads * 16 dims * 4.
BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4
PROMPT = "Once upon a time there was a tiny language model"


def openai_client(server):
    """The openai client the server tests use: the test API key, no retries."""
    import openai
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def authed_http(server):
    """An httpx client on the server with the test API key (a context manager)."""
    import httpx
    return httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)


def tiny_server_args(*extra: str, kv_blocks: int = KV_BLOCKS) -> list[str]:
    return ["--dtype", "float32", "--kv-cache-memory", str(kv_blocks * BLOCK_BYTES), "--log-stats-interval", "0.5",
            "--disable-uvicorn-access-log", *extra]


def api_server_args(*extra: str, names: tuple[str, ...] = ("tiny",), kv_blocks: int = KV_BLOCKS) -> list[str]:
    """tiny_server_args behind the test API key, served as `names`, stopped without a grace period."""
    return tiny_server_args("--api-key", API_KEY, "--served-model-name", *names, "--shutdown-timeout", "0", *extra,
                            kv_blocks=kv_blocks)


def served(model, log_dir: Path, args: list[str], **launch):
    """The body of a server fixture (`yield from served(...)`): the server on `model` with `args`, its
    log in log_dir; at teardown it must stop cleanly (its log's tail otherwise)."""
    from pagedserve.server.launcher import launch_server
    srv = launch_server(model, args, log_dir / "server.log", **launch)
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


def metrics(http) -> dict[str, float]:
    """`name{labels}` -> value from /metrics (label model_name dropped)."""
    out = {}
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, value = line.rsplit(" ", 1)
        name = re.sub(r',?model_name="[^"]*",?', "", name).replace("{}", "")
        out[name] = float(value)
    return out


def wait_idle(http, timeout: float = 10.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(http)
        idle = m["pagedserve:num_requests_running"] == 0 and m["pagedserve:num_requests_waiting"] == 0 \
            and m["pagedserve:kv_cache_usage_perc"] == 0
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def sse_events(lines) -> list:
    events = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def rss_bytes(pid: int) -> int:
    """Resident memory of a process (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")
