"""The KV-cache dashboard on a real server (a subprocess on the tiny model, with an API key):
/v1/kv/snapshot and the event stream over HTTP, then the page itself in headless Chromium
(Playwright driving Debian's chromium; nothing is downloaded).

Browser tests skip only where no Chromium exists and this is not CI; CI must run them
(.ci/run installs chromium when it is missing). The page's screenshot is saved under
test-artifacts/ (or $PAGEDSERVE_TEST_ARTIFACTS).
"""
from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest

from pagedserve.engine.kv_view import apply_update
from tests.fault_server import SLOW_STEPS
from tests.server_utils import API_KEY, KV_BLOCKS, api_server_args, served, wait_idle

ARTIFACTS = Path(os.environ.get("PAGEDSERVE_TEST_ARTIFACTS") or Path(__file__).resolve().parent.parent /
                 "test-artifacts")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
LONG_PROMPT = ("Once upon a time there was a tiny language model that liked to count: one two three four five. "
               "Paged attention stores keys and values in fixed-size blocks.")


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    yield from served(tiny_llama.path, tmp_path_factory.mktemp("dashboard"),
                      api_server_args("--kv-snapshot-interval", "0.1"), module="tests.fault_server")


def complete_in_background(http, **body) -> tuple[threading.Thread, dict]:
    """A completion on another thread; the returned dict gets its response."""
    result = {}

    def run():
        result["response"] = http.post("/v1/completions", json={"model": "tiny", **body}).json()
    thread = threading.Thread(target=run)
    thread.start()
    return thread, result


def shared_run(http, **extra) -> tuple[threading.Thread, dict]:
    """n=4 over a prompt of several full blocks, long enough to be watched while it runs: its
    steps are slowed (tests/fault_server.py SLOW_STEPS), so its 150 tokens take at least 3 s
    however fast the machine (a snapshot comes every 0.1 s)."""
    return complete_in_background(http, prompt=f"{LONG_PROMPT} {SLOW_STEPS}", n=4, max_tokens=150, temperature=1.0,
                                  seed=1, ignore_eos=True, **extra)


def read_events(lines, until, timeout: float = 120.0):
    """(event, data) pairs from an SSE response's lines until `until(events)` holds."""
    events = []
    deadline = time.monotonic() + timeout
    event = None
    for line in lines:
        if line.startswith("event: "):
            event = line[len("event: "):]
        elif line.startswith("data: "):
            events.append((event, json.loads(line[len("data: "):])))
            if until(events):
                return events
        assert time.monotonic() < deadline, f"stream: condition not met in {timeout} s"
    raise AssertionError("the stream ended")


# ---- over HTTP ----------------------------------------------------------------------------------

def test_the_page_loads_without_the_key_and_the_data_needs_it(server, http):
    for path in ("/dashboard", "/dashboard/dashboard.js", "/dashboard/dashboard.css"):
        r = httpx.get(server.url + path)
        assert r.status_code == 200 and r.text
    assert "block-map" in httpx.get(server.url + "/dashboard").text
    for path in ("/v1/kv/snapshot", "/v1/kv/stream"):
        r = httpx.get(server.url + path)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(server.url + path, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(server.url + "/dashboard/other.js").status_code == 401   # not a page file: gated
    wait_idle(http)
    snap = http.get("/v1/kv/snapshot").json()
    assert snap["num_blocks"] == KV_BLOCKS == len(snap["blocks"]) and snap["requests"] == []
    assert not [b for b in snap["blocks"] if b["state"] in ("owned", "shared")]


def test_the_stream_shows_shared_blocks_then_their_release(http):
    """The first event is the whole picture; updates applied to it show an n=4 request's shared
    prompt blocks while it runs and nothing held once it is done, and end equal to /v1/kv/snapshot."""
    wait_idle(http)
    with http.stream("GET", "/v1/kv/stream") as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        thread, result = None, None
        page = None
        lines = response.iter_lines()

        def watch(events):
            nonlocal thread, result, page
            kind, data = events[-1]
            page = data if kind == "snapshot" else apply_update(page, data)
            if thread is None:
                assert kind == "snapshot" and len(data["blocks"]) == KV_BLOCKS
                thread, result = shared_run(http)
            return any(b["state"] == "shared" and b["ref_cnt"] == 4 for b in page["blocks"])
        read_events(lines, watch)
        (req,) = page["requests"]
        assert len(req["seqs"]) == 4 and req["n"] == 4
        shared = [b for b in page["blocks"] if b["state"] == "shared"]
        assert all(b["owners"] == [req["id"]] for b in shared)
        tables = [s["block_table"] for s in req["seqs"]]
        assert all(t[:len(shared)] == tables[0][:len(shared)] for t in tables)
        thread.join()
        assert f"{result['response']['id']}-0" == req["id"]

        def settled(events):
            nonlocal page
            kind, data = events[-1]
            page = data if kind == "snapshot" else apply_update(page, data)
            return not page["requests"] and page["counters"]["num_used_blocks"] == 0
        read_events(lines, settled)
    assert not [b for b in page["blocks"] if b["state"] in ("owned", "shared")]
    assert [b for b in page["blocks"] if b["state"] == "cached" and b.get("text")]
    fresh = http.get("/v1/kv/snapshot").json()
    for name in ("time", "step"):
        fresh.pop(name), page.pop(name)
    assert page == fresh


def test_the_hub_sends_the_picture_then_changes_and_ends_streams_on_close(tiny_llama):
    """In process, on an offline engine: a new listener gets the whole picture, then updates with
    the blocks that changed; close() (the server's SIGTERM drain) ends every stream; a listener
    too slow to keep up is sent the whole picture again instead of a gap."""
    import asyncio

    from pagedserve import SamplingParams
    from pagedserve.engine.kv_view import capture
    from pagedserve.server.dashboard import QUEUE_LIMIT, KVStreamHub
    from tests.test_engine import make_llm
    llm = make_llm(tiny_llama, num_gpu_blocks_override=32)

    class Engine:   # what the hub asks of AsyncLLM, answered on this (the engine's) thread
        config, model_path, tokenizer = llm.engine.config, llm.engine.model_path, llm.engine.tokenizer

        async def kv_capture(self):
            return capture(llm.engine)

    def event(text: str) -> tuple[str, dict]:
        head, data = text.strip().split("\n")
        return head[len("event: "):], json.loads(data[len("data: "):])

    async def run():
        hub = KVStreamHub(Engine(), interval=0.01)
        stream = hub.stream()
        kind, page = event(await anext(stream))
        assert kind == "snapshot" and len(page["blocks"]) == 32
        llm.engine.add_request("a", {"prompt_token_ids": list(range(3, 40))}, SamplingParams(max_tokens=4))
        llm.engine.step()
        kind, update = event(await anext(stream))
        assert kind == "update" and [b["id"] for b in update["blocks"] if b["state"] == "owned"]
        page = apply_update(page, update)
        slow = hub.stream()
        assert event(await anext(slow))[0] == "snapshot"
        while not [q for q in hub._listeners if q.qsize() >= QUEUE_LIMIT]:   # `slow` reads nothing more
            if not llm.engine.has_unfinished_requests():
                llm.engine.add_request(f"r{llm.engine.num_steps}", {"prompt_token_ids": list(range(5, 30))},
                                       SamplingParams(max_tokens=3))
            llm.engine.step()    # every step changes something: one update each
            page = apply_update(page, event(await anext(stream))[1])
        llm.engine.step()        # one more: the slow queue overflows and is emptied
        kind, update = event(await anext(stream))
        assert kind == "update"
        page = apply_update(page, update)
        while event(item := await anext(slow))[0] == "update":
            pass
        kind, whole = event(item)
        assert kind == "snapshot"
        for name in ("time", "step"):
            whole.pop(name), page.pop(name)
        assert whole == page     # what the slow listener gets now is what the other one has built
        hub.close()
        for s in (stream, slow):
            with pytest.raises(StopAsyncIteration):
                while True:
                    await anext(s)
    asyncio.run(run())


# ---- in the browser -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def browser():
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        sync_playwright = None
    if chromium is None or sync_playwright is None:
        missing = "Debian's chromium (apt-get install -y chromium)" if chromium is None else "playwright (pip)"
        if os.environ.get("CI"):
            pytest.fail(f"CI must run the browser tests, but {missing} is missing")
        pytest.skip(f"no browser here: {missing} is missing (CI installs it and runs these)")
    with sync_playwright() as p:
        # Playwright launches with a fresh temporary profile (user data dir) of its own.
        b = p.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser, server):
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    pg = context.new_page()
    yield pg
    context.close()


def open_dashboard(pg, server) -> None:
    """Load the page and give it the key when it asks (a wrong one first: it asks again)."""
    pg.goto(server.url + "/dashboard")
    pg.wait_for_selector("#auth:not([hidden])")
    pg.fill("#api-key", "wrong")
    pg.click("#auth button")
    pg.wait_for_function("document.getElementById('auth-error').textContent.includes('refused')")
    pg.fill("#api-key", API_KEY)
    pg.click("#auth button")
    pg.wait_for_selector("#status[data-connected='1']")
    pg.wait_for_function(f"document.querySelectorAll('#block-map .cell').length === {KV_BLOCKS}")


def states(pg) -> dict[str, int]:
    return pg.evaluate("""() => {
        const out = {};
        for (const c of document.querySelectorAll('#block-map .cell')) out[c.dataset.state] = (out[c.dataset.state] || 0) + 1;
        return out; }""")


def test_the_page_shows_blocks_change_as_requests_run(page, server, http):
    wait_idle(http)
    open_dashboard(page, server)
    assert page.locator("#block-map .cell").count() == KV_BLOCKS
    ids = page.evaluate("[...document.querySelectorAll('#block-map .cell')].map(c => Number(c.dataset.blockId))")
    assert ids == list(range(KV_BLOCKS))
    before = states(page)
    assert not before.get("owned") and not before.get("shared")
    thread, _ = shared_run(http)
    # An n=4 request: its prompt's full blocks shared four ways, in the map and in its block tables.
    # Read in one go (one JavaScript task: no update lands in between), the request may end any time.
    page.wait_for_selector("#block-map .cell[data-state='shared'][data-ref-cnt='4']", timeout=120_000)
    seen = page.evaluate("""() => {
        document.querySelector("#requests [data-queue='running'] .req").click();
        const rows = [...document.querySelectorAll('#tables .seqrow')].map(
            r => [...r.querySelectorAll('.chip')].map(c => [c.dataset.blockId, c.dataset.state]));
        const selected = document.querySelectorAll('#block-map .cell.selected').length;
        document.querySelector(`#block-map .cell[data-block-id='${rows[0][0][0]}']`).click();
        const ref = document.querySelector("#detail [data-field='ref_count']").textContent;
        return {rows, selected, ref}; }""")
    rows = seen["rows"]
    assert len(rows) == 4 and len({r[0][0] for r in rows}) == 1 and rows[0][0][1] == "shared"
    assert seen["selected"] >= 4 and seen["ref"] == "4"
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)
    thread.join()
    # Finished: nothing held, the prompt's blocks stay cached (evictable) with their text.
    page.wait_for_function("!document.querySelector(\"#block-map .cell[data-state='owned'], "
                           "#block-map .cell[data-state='shared']\")", timeout=60_000)
    after = states(page)
    assert after.get("cached", 0) >= 2 and after.get("free", 0) + after["cached"] == KV_BLOCKS
    page.click("#block-map .cell[data-state='cached']")
    assert page.inner_text("#detail [data-field='text']")
    assert page.inner_text("#detail [data-field='hash']").endswith("...")


COUNTERS = {  # the page's counter -> the /metrics series it must equal
    "prompt_tokens": "pagedserve:prompt_tokens_total",
    "generation_tokens": "pagedserve:generation_tokens_total",
    "num_preemptions": "pagedserve:num_preemptions_total",
    "num_running": "pagedserve:num_requests_running",
    "num_waiting": "pagedserve:num_requests_waiting",
    "kv_cache_usage": "pagedserve:kv_cache_usage_perc",
}


def test_the_counters_agree_with_metrics_and_the_key_is_asked_once(page, server, http):
    open_dashboard(page, server)
    thread, _ = complete_in_background(http, prompt=["The quick brown fox", "Paged attention"], max_tokens=40,
                                       ignore_eos=True)
    thread.join()
    m = wait_idle(http)
    assert m["pagedserve:generation_tokens_total"] > 0

    def shown() -> dict[str, float]:
        return page.evaluate("""() => Object.fromEntries([...document.querySelectorAll('#counters [data-counter]')]
                                .map(d => [d.dataset.counter, d.dataset.value === '' ? null : Number(d.dataset.value)]))""")
    want = {name: m[series] for name, series in COUNTERS.items()}
    want["ttft_count"] = m["pagedserve:time_to_first_token_seconds_count"]
    deadline = time.monotonic() + 30
    while {k: shown().get(k) for k in COUNTERS} != {k: want[k] for k in COUNTERS} and time.monotonic() < deadline:
        time.sleep(0.1)
    assert {k: shown().get(k) for k in COUNTERS} == {k: want[k] for k in COUNTERS}
    snap = page.evaluate("window.pagedserveDashboard.page().counters")
    assert snap["ttft_count"] == want["ttft_count"]
    assert snap["ttft_sum"] == pytest.approx(m["pagedserve:time_to_first_token_seconds_sum"])
    assert snap["prefix_cache_hits"] == m["pagedserve:prefix_cache_hits_total"]
    # A reload in the same tab does not ask again.
    page.reload()
    page.wait_for_selector("#status[data-connected='1']")
    assert page.locator("#auth").is_hidden()


# ---- the offline replay (--kv-map) --------------------------------------------------------------

@pytest.fixture(scope="module")
def kv_map(tiny_llama, tmp_path_factory) -> Path:
    """`pagedserve generate --kv-map` run as a user would, on two prompts."""
    import subprocess
    import sys
    path = tmp_path_factory.mktemp("kv_map") / "run.html"
    res = subprocess.run([sys.executable, "-m", "pagedserve.cli", "generate", "--model", tiny_llama.path,
                          "--dtype", "float32", "--kv-cache-memory", str(64 * 8192), "--prompt", LONG_PROMPT,
                          "--prompt", "The quick brown fox", "--max-tokens", "24", "--kv-map", str(path)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "KV map of" in res.stderr and path.exists()
    return path


def test_the_kv_map_is_self_contained(kv_map):
    html = kv_map.read_text()
    assert "/dashboard/" not in html and "http://" not in html and "https://" not in html
    assert "window.PAGEDSERVE_REPLAY" in html and "<link" not in html


def test_the_kv_map_replays_in_the_browser(browser, kv_map):
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    pg = context.new_page()
    errors = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.goto(kv_map.as_uri())
    pg.wait_for_selector("#replay-controls:not([hidden])")
    frames = pg.evaluate("window.pagedserveReplay.frames")
    num_blocks = pg.evaluate("window.pagedserveDashboard.page().num_blocks")
    assert frames > 24 and pg.locator("#block-map .cell").count() == num_blocks == 64
    held = []
    for i in range(frames):
        pg.evaluate(f"window.pagedserveReplay.show({i})")
        held.append(states(pg).get("owned", 0))
    assert held[0] == 0 and max(held) > 0 and held[-1] == 0      # empty, running, done
    assert states(pg).get("cached", 0) >= 2                       # the prompts' full blocks stay cached
    pg.evaluate("window.pagedserveReplay.show(0)")                # back in time rebuilds from the start
    assert states(pg) == {"free": 64}
    assert not errors
    context.close()
