"""The multi-model server (`serve --models-dir DIR` or `--model NAME=PATH`...): the routes about
the set of models, and every other request handed to the routes of the model it names.

`ModelDispatch` (pure ASGI) reads a request's body, finds the model (the JSON body's `model`, or
Ollama's `name`; for a GET the `model` query parameter; none: the first model), leases it from the
`ModelManager` (loading it first: the request waits, others go on) and hands the request, its body
replayed, to that model's own app (app.py's build_app over the model's ServerState: every route a
one-model server has), releasing the lease once the response is sent (a stream at its end) with the
request's `keep_alive`. Routes about the set are answered here: /v1/models and /models (with each
model's status), /models/load and /models/unload (llama.cpp's), Ollama's /api/tags, /api/ps,
/api/version, /api/pull and /api/delete, /metrics (every loaded model's series, by model_name, and
the manager's own), /health. The gate (API key, body size, shutdown drain) is app.py's, in front of
it all; the shutdown drain aborts every loaded model's requests.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any
from urllib.parse import parse_qs, urlsplit

import uvicorn
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily

import pagedserve
from pagedserve.config import EngineConfig
from pagedserve.server.app import GateMiddleware, _Server, add_process_routes, build_app, make_engine_client, server_state, shaped_error
from pagedserve.server.config import ServerConfig
from pagedserve.server.errors import APIError, bad_request, install_error_handlers
from pagedserve.server.lora import check_startup_adapters
from pagedserve.server.metrics import CONTENT_TYPE_LATEST
from pagedserve.server.model_specs import ModelSpec, parse_duration
from pagedserve.server.models_manager import LoadedModel, ModelEntry, ModelManager
from pagedserve.server.ollama import NOT_SUPPORTED_PATHS, not_supported, ollama_model, ollama_time
from pagedserve.server.state import ServerState

logger = logging.getLogger("pagedserve.server")

# Answered by the top-level app; every other path is a model's.
TOP_PATHS = {"/health", "/ping", "/version", "/load", "/metrics", "/v1/models", "/models", "/models/load",
             "/models/unload", "/api/tags", "/api/ps", "/api/version", "/docs", "/openapi.json", "/redoc",
             *NOT_SUPPORTED_PATHS}


class ModelDispatch:
    def __init__(self, top: FastAPI, manager: ModelManager) -> None:
        self.top = top
        self.manager = manager

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in TOP_PATHS:
            await self.top(scope, receive, send)
            return
        path = scope["path"]
        try:
            body = await _read_body(receive)
            if body is None:
                return   # the client went away before its body arrived
            name, keep_alive, empty = _model_of(scope, body)
            if keep_alive is not None and not path.startswith("/api/"):   # this server's field, not the route's
                data = json.loads(body)
                del data["keep_alive"]
                body = json.dumps(data).encode()
            if empty and keep_alive == 0:   # Ollama: an empty generate/chat with keep_alive 0 unloads
                entry = await self.manager.unload(self.manager.resolve(name).name, "a request's keep_alive 0")
                await _ollama_done(entry.name, "unload", path)(scope, receive, send)
                return
            started = time.monotonic()
            entry = await self.manager.acquire(name)
            # What the request waited for its model (Ollama's load_duration), in Starlette's request.state.
            scope.setdefault("state", {})["model_wait_seconds"] = time.monotonic() - started
        except APIError as e:
            await shaped_error(path, e)(scope, receive, send)
            return
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()
        try:
            if empty:   # Ollama: an empty generate/chat only loads the model
                await _ollama_done(entry.name, "load", path)(scope, replay, send)
            else:
                await entry.loaded.app(scope, replay, send)
        finally:
            self.manager.release(entry, keep_alive)


async def _read_body(receive) -> bytes | None:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _model_of(scope, body: bytes) -> tuple[str | None, float | None, bool]:
    """(the model named, the request's keep_alive in seconds, whether it is an Ollama generate or
    chat with nothing to generate: a load or an unload)."""
    data: Any = None
    if body:
        with contextlib.suppress(ValueError):
            data = json.loads(body)
    data = data if isinstance(data, dict) else {}
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    name = data.get("model") or (data.get("name") if scope["path"].startswith("/api/") else None) or \
        (query.get("model") or [None])[0] or _referer_model(scope)
    if name is not None and not isinstance(name, str):
        raise bad_request("model must be a string", "model")
    keep_alive = None
    if data.get("keep_alive") is not None:
        try:
            keep_alive = parse_duration(data["keep_alive"])
        except ValueError as e:
            raise bad_request(str(e), "keep_alive") from None
    empty = (scope["path"] == "/api/generate" and not data.get("prompt") and not data.get("suffix")) or \
        (scope["path"] == "/api/chat" and not data.get("messages"))
    return name, keep_alive, empty


def _referer_model(scope) -> str | None:
    """The model of the page a request comes from: /dashboard?model=NAME's own requests (its KV
    stream and snapshots) name none, so they go to the model the page was opened for."""
    referer = dict(scope["headers"]).get(b"referer", b"").decode("latin-1")
    return (parse_qs(urlsplit(referer).query).get("model") or [None])[0] if referer else None


def _ollama_done(name: str, reason: str, path: str) -> Response:
    body = {"model": name, "created_at": ollama_time(time.time()), "done": True, "done_reason": reason}
    body.update({"message": {"role": "assistant", "content": ""}} if path == "/api/chat" else {"response": ""})
    return JSONResponse(body)


# ---- the routes about the set of models ---------------------------------------------------------
def _status(entry: ModelEntry) -> dict[str, Any]:
    status: dict[str, Any] = {"value": entry.status}
    if entry.status == "loading" and entry.progress:
        status["progress"] = entry.progress
    if entry.error:
        status["error"] = entry.error
    if entry.status == "loaded":
        status["expires_at"] = entry.expires_at
    return status


def model_cards(manager: ModelManager) -> list[dict[str, Any]]:
    cards = []
    for entry in manager.entries.values():
        loaded = entry.loaded
        cards.append({"id": entry.name, "object": "model", "created": int(time.time()), "owned_by": "pagedserve",
                      "root": entry.spec.path, "parent": None,
                      "max_model_len": loaded.llm.max_model_len if loaded else entry.config.max_model_len,
                      "status": _status(entry)})
    for adapter, base in manager.aliases.items():
        cards.append({"id": adapter, "object": "model", "created": int(time.time()), "owned_by": "pagedserve",
                      "root": None, "parent": base, "status": _status(manager.entries[base])})
    return cards


class _Merged:
    """Every loaded model's metric families as one (each series labelled with its model_name),
    plus the manager's gauges."""

    def __init__(self, manager: ModelManager) -> None:
        self.manager = manager

    def collect(self):
        families: dict[str, Any] = {}
        for entry in self.manager.entries.values():
            if entry.loaded is None:
                continue
            for family in entry.loaded.state.metrics.registry.collect():
                if family.name in families:
                    families[family.name].samples.extend(family.samples)
                else:
                    family.samples = list(family.samples)
                    families[family.name] = family
        prefix = self.manager.server.metrics_prefix
        loaded = GaugeMetricFamily(prefix + "model_loaded", "1 while the model is loaded (multi-model server).",
                                   labels=["model_name"])
        loads = GaugeMetricFamily(prefix + "model_loads", "Times the model was loaded.", labels=["model_name"])
        for entry in self.manager.entries.values():
            loaded.add_metric([entry.name], 1.0 if entry.status == "loaded" else 0.0)
            loads.add_metric([entry.name], float(entry.loads))
        return [*families.values(), loaded, loads]


def build_top_app(state: ServerState, manager: ModelManager, server: ServerConfig) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state.loop = asyncio.get_running_loop()
        manager.start()
        logger.info("serving %d models on demand: %s", len(manager.entries), ", ".join(manager.entries))
        yield
        state.shutting_down = True
        await manager.shutdown(timeout=5.0)

    no_docs = dict(docs_url=None, redoc_url=None, openapi_url=None) if server.disable_fastapi_docs else {}
    app = FastAPI(title="pagedserve", version=pagedserve.__version__, lifespan=lifespan, **no_docs)
    app.state.server = state
    install_error_handlers(app)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(manager))

    add_process_routes(app, state)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    @app.get("/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": model_cards(manager)})

    async def _named(raw: Request) -> str:
        data = await raw.body()
        try:
            name = json.loads(data).get("model")
        except (ValueError, AttributeError):
            name = None
        if not isinstance(name, str) or not name:
            raise bad_request('the body must be {"model": NAME}', "model")
        return name

    @app.post("/models/load")
    async def load_model(raw: Request) -> JSONResponse:
        await manager.load(await _named(raw))
        return JSONResponse({"success": True})

    @app.post("/models/unload")
    async def unload_model(raw: Request) -> JSONResponse:
        await manager.unload(await _named(raw))
        return JSONResponse({"success": True})

    @app.get("/api/version")
    async def ollama_version() -> dict:
        return {"version": pagedserve.__version__}

    @app.get("/api/tags")
    async def ollama_tags() -> JSONResponse:
        return JSONResponse({"models": [ollama_model(e.name, e.spec.path, e.spec.weight_bytes(), e.config)
                                        for e in manager.entries.values()]})

    @app.get("/api/ps")
    async def ollama_ps() -> JSONResponse:
        models = []
        for e in manager.entries.values():
            if e.status != "loaded":
                continue
            expires = e.expires_at if e.leases == 0 else None
            item = ollama_model(e.name, e.spec.path, e.loaded.memory_bytes or e.spec.weight_bytes(), e.config)
            item.update(expires_at=ollama_time(expires) if expires is not None else ollama_time(time.time() + 3.15e8),
                        size_vram=0, context_length=e.loaded.llm.max_model_len)
            models.append(item)
        return JSONResponse({"models": models})

    for path in NOT_SUPPORTED_PATHS:
        app.add_api_route(path, not_supported, methods=["POST", "DELETE", "GET", "HEAD"])
    return app


# ---- running it ---------------------------------------------------------------------------------
def model_starter(server: ServerConfig):
    """What the manager calls to load a model: its engine client, started, and its routes."""
    async def start(entry: ModelEntry) -> LoadedModel:
        s = entry.server
        import dataclasses
        s = dataclasses.replace(s, allowed_origins=[], api_key=None)   # the top level's gate and CORS
        llm, metrics = make_engine_client(entry.config, s)
        llm.start()
        try:
            await llm.wait_started()
        except BaseException:
            await llm.shutdown(timeout=5.0)
            raise
        state = server_state(entry.config, s, llm, metrics, max_request_body_bytes=None)
        state.loop = asyncio.get_running_loop()
        # The prompt lanes (the vocabulary's longest token, the template's cost of a message) are part
        # of the load, not of its first request's TTFT; off the event loop: other models keep serving.
        await asyncio.to_thread(lambda: state.prompts)
        if state.loras is not None:
            await check_startup_adapters(state)
        return LoadedModel(llm, state, build_app(state, s), 0)
    return start


def run_multi_server(specs: list[ModelSpec], base: EngineConfig, server: ServerConfig) -> int:
    """Serve the models until SIGTERM/SIGINT; returns the exit status."""
    s = server
    if s.data_parallel_size > 1:
        raise ValueError("--data-parallel-size is not supported with several models")
    manager = ModelManager(specs, base, s, model_starter(s))
    state = ServerState(manager, list(manager.entries), None, api_key=s.api_key,  # type: ignore[arg-type]
                        shutdown_timeout=s.shutdown_timeout,
                        max_request_body_bytes=s.max_request_body_bytes if s.max_request_body_bytes and
                        s.max_request_body_bytes > 0 else None, log_requests=not s.disable_log_requests, options=s)
    top = build_top_app(state, manager, s)
    app: Any = GateMiddleware(ModelDispatch(top, manager), state)
    if s.allowed_origins:
        app = CORSMiddleware(app, allow_origins=s.allowed_origins, allow_methods=s.allowed_methods,
                             allow_headers=s.allowed_headers, allow_credentials=s.allow_credentials)
    uv_config = uvicorn.Config(app, host=s.host, port=s.port, log_level=s.uvicorn_log_level,
                               access_log=not s.disable_uvicorn_access_log,
                               timeout_graceful_shutdown=int(s.shutdown_timeout) + 5)
    uv_server = _Server(uv_config, state)
    uv_server.run()
    return 0 if uv_server.started else 1
