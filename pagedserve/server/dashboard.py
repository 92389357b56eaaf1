"""The live KV-cache dashboard: the page, /v1/kv/snapshot, and a server-sent-events stream of changes.

The page (`dashboard/`: plain HTML, CSS and JavaScript, no build step) is the same static
code for everyone and holds no data, so it loads without the API key; everything it shows
comes from /v1/kv/snapshot and /v1/kv/stream, which sit behind --api-key like every other
route. The page asks for the key once and sends it as a Bearer header (it reads the
stream with fetch, since EventSource cannot send headers).

One `KVStreamHub` feeds every open page: while anyone listens, it asks the engine thread
for a capture every `interval` seconds (taken between two steps: a few list copies),
renders it on a worker thread, and sends each listener the blocks that changed (a new
listener first gets the whole picture). Nobody listening: nothing is captured.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse

from pagedserve.engine.protocol import EngineClient
from pagedserve.engine.kv_view import KVView, apply_update
from pagedserve.server.errors import APIError

logger = logging.getLogger("pagedserve.server")

STATIC = Path(__file__).resolve().parent.parent / "dashboard"   # the page: static files
# The page's files: open without the API key (static code, no data).
PAGE_FILES = {"/dashboard": "index.html", "/dashboard/dashboard.js": "dashboard.js",
              "/dashboard/dashboard.css": "dashboard.css"}
DEFAULT_INTERVAL = 0.5       # seconds between snapshots while a page listens
KEEPALIVE = 15.0             # seconds of silence before a comment line keeps proxies from closing the stream
QUEUE_LIMIT = 16             # events a slow listener may lag behind before it is sent the whole picture again


def sse(event: str, data: dict[str, Any]) -> str:
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


class KVStreamHub:
    def __init__(self, llm: EngineClient, interval: float = DEFAULT_INTERVAL,
                 run: Callable[..., Awaitable[Any]] = asyncio.to_thread) -> None:
        """`run(fn, *args)`: where the page's text is made, off the event loop (the server runs it
        on the prompt thread, the one that uses the front-end tokenizer)."""
        if not interval > 0:
            raise ValueError(f"the KV snapshot interval must be > 0 seconds; got {interval}")
        self.llm = llm
        self.interval = interval
        self._view: KVView | None = None
        self._page: dict[str, Any] | None = None        # the whole picture so far
        self._listeners: dict[asyncio.Queue, bool] = {}  # queue -> needs the whole picture
        self._task: asyncio.Task | None = None
        self._run_off_loop = run

    async def snapshot(self) -> dict[str, Any]:
        """The whole picture now (for /v1/kv/snapshot)."""
        cap = await self._capture()
        return await self._run_off_loop(KVView(self._decode).full, cap)

    async def stream(self) -> AsyncIterator[str]:
        queue: asyncio.Queue = asyncio.Queue(QUEUE_LIMIT)
        self._listeners[queue] = True
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run())
        try:
            while True:
                try:
                    item = await asyncio.wait_for(queue.get(), KEEPALIVE)
                except TimeoutError:
                    yield ": keepalive\n\n"
                    continue
                if item is None:   # the engine is gone: the page reconnects later
                    return
                yield item
        finally:
            self._listeners.pop(queue, None)

    def close(self) -> None:
        """End every stream (the server is shutting down; the pages reconnect to whatever comes next)."""
        for queue in list(self._listeners):
            self._put(queue, None)

    async def _capture(self):
        try:
            return await self.llm.kv_capture()
        except RuntimeError as e:   # not ready, shutting down, dead
            raise APIError(503, f"no KV snapshot: {e}") from None

    def _decode(self, token_ids: list[int]) -> str:
        """Off the event loop, with the front end's tokenizer (engine/tokenizer.py)."""
        return self.llm.tokenizer.decode(token_ids)

    async def _run(self) -> None:
        try:
            while self._listeners:
                try:
                    cap = await self.llm.kv_capture()
                except RuntimeError:
                    for queue in list(self._listeners):
                        self._put(queue, None)
                    return
                fresh = [q for q, whole in self._listeners.items() if whole]
                update, whole = await self._run_off_loop(self._advance, cap, bool(fresh))
                for queue in list(self._listeners):
                    if queue in fresh:
                        self._listeners[queue] = False
                        self._put(queue, whole)
                    elif update is not None:
                        self._put(queue, update)
                await asyncio.sleep(self.interval)
        except Exception:   # noqa: BLE001 - the stream ends; the page reconnects
            logger.exception("the KV stream failed")
            for queue in list(self._listeners):
                self._put(queue, None)
        finally:
            self._view = self._page = None

    def _advance(self, cap, want_whole: bool) -> tuple[str | None, str | None]:
        """On a worker thread: the update event since the last capture, and the whole picture
        as an event if a new listener needs it."""
        if self._view is None or self._page is None:
            self._view = KVView(self._decode)
            self._page = self._view.full(cap)
            return None, sse("snapshot", self._page)
        update = self._view.update(cap)
        if update is not None:
            self._page = apply_update(self._page, update)
        return (None if update is None else sse("update", update),
                sse("snapshot", self._page) if want_whole else None)

    def _put(self, queue: asyncio.Queue, item: str | None) -> None:
        try:
            queue.put_nowait(item)
        except asyncio.QueueFull:   # a slow listener: drop what it missed, send the whole picture next
            with contextlib.suppress(asyncio.QueueEmpty):
                while True:
                    queue.get_nowait()
            self._listeners[queue] = True
            if item is None:
                queue.put_nowait(None)


def add_dashboard_routes(app: FastAPI, hub: KVStreamHub) -> None:
    for path, name in PAGE_FILES.items():
        app.add_api_route(path, _page_file(STATIC / name), methods=["GET"], include_in_schema=False)

    @app.get("/v1/kv/snapshot")
    async def kv_snapshot() -> JSONResponse:
        return JSONResponse(await hub.snapshot())

    @app.get("/v1/kv/stream")
    async def kv_stream() -> StreamingResponse:
        return StreamingResponse(hub.stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _page_file(path: Path):
    async def serve() -> FileResponse:
        return FileResponse(path, headers={"Cache-Control": "no-cache"})
    return serve
