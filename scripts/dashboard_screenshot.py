"""Take the dashboard screenshot of docs/memory.md (docs/dashboard.png) on the default model.

    .venv/bin/python scripts/dashboard_screenshot.py [--out docs/dashboard.png]

Starts `pagedserve serve` on a free port with a small KV cache, sends chat requests that
share a system prompt (prefix-cache hits), one n=4 completion (shared prompt blocks) and a
few short ones that finish and leave cached blocks, opens /dashboard in headless Chromium
(Debian's, through Playwright), selects the n=4 request and a cached block, and saves the page.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pagedserve.server.launcher import launch_server  # noqa: E402

SYSTEM = ("You are a helpful assistant for a team that serves language models. Answer briefly and precisely, "
          "cite the relevant idea by name, and say when you are unsure.")
QUESTIONS = ["What is paged attention?", "Why does a KV cache need memory management?",
             "What is continuous batching?", "How does prefix caching save work?"]
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync"]
BLOCK_BYTES = 2 * 30 * 16 * 3 * 64 * 4      # SmolLM2-135M, float32: K and V, 30 layers, 16 tokens, 3 heads x 64


def post(http: httpx.Client, path: str, body: dict) -> None:
    http.post(path, json={"model": "HuggingFaceTB/SmolLM2-135M-Instruct", **body})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "docs" / "dashboard.png")
    ap.add_argument("--blocks", type=int, default=128)
    args = ap.parse_args()
    from playwright.sync_api import sync_playwright
    chromium = shutil.which("chromium") or sys.exit("needs Debian's chromium: apt-get install -y chromium")
    log = Path(tempfile.mkdtemp()) / "server.log"
    with launch_server(None, ["--dtype", "float32", "--kv-cache-memory", str(args.blocks * BLOCK_BYTES),
                              "--kv-snapshot-interval", "0.25", "--disable-uvicorn-access-log"], log) as srv, \
            httpx.Client(base_url=srv.url, timeout=600) as http, sync_playwright() as p:
        for q in QUESTIONS[:2]:   # finished before the page opens: their blocks stay cached
            post(http, "/v1/chat/completions", {"messages": [{"role": "system", "content": SYSTEM},
                                                             {"role": "user", "content": q}], "max_tokens": 16})
        browser = p.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1050})
        page.goto(srv.url + "/dashboard")
        page.wait_for_selector("#status[data-connected='1']")
        jobs = [threading.Thread(target=post, args=(http, "/v1/completions", {
            "prompt": "The vLLM paper introduced PagedAttention, which stores the KV cache in blocks. " * 3,
            "n": 4, "max_tokens": 300, "temperature": 0.8, "seed": 0, "ignore_eos": True}))]
        jobs += [threading.Thread(target=post, args=(http, "/v1/chat/completions", {
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
            "max_tokens": 250, "ignore_eos": True})) for q in QUESTIONS]
        for job in jobs:
            job.start()
        page.wait_for_selector("#block-map .cell[data-state='shared'][data-ref-cnt='4']", timeout=300_000)
        deadline = time.monotonic() + 240   # let the tables grow and the charts fill
        while time.monotonic() < deadline and float(
                page.get_attribute("[data-counter='kv_cache_usage']", "data-value") or 0) < 0.45:
            time.sleep(0.5)
        page.locator("#requests [data-queue='running'] .req").first.click()
        page.hover("#block-map .cell[data-state='cached']")
        args.out.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(args.out), full_page=True)
        print(f"wrote {args.out}")
        browser.close()
        for job in jobs:
            job.join()


if __name__ == "__main__":
    main()
