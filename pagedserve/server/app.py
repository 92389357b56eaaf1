"""The OpenAI-compatible HTTP server: FastAPI routes over one AsyncLLM.

The server listens at once and answers 503 until the model is loaded. SIGTERM
(or Ctrl-C) starts a drain: the server keeps listening but answers every new
request 503 (/health too, so a load balancer stops sending), gives the requests
in flight `shutdown_timeout` seconds to finish, aborts the rest (their clients get
an OpenAI-shaped 503; one not yet in the engine, e.g. still tokenizing, is answered
503 by the gate a second later) and exits 0; grammar compiles are cancelled and no
worker thread holds the exit. A second signal exits at once (aborting what is left).
If the engine dies (a fault it cannot recover from), /health and every request get
503, the requests in flight fail, and the server exits 1 for a supervisor to
restart it.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging

import uvicorn
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response

import pagedserve
from pagedserve.config import EngineConfig, server_grammar_warmup
from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.engine.protocol import EngineClient
from pagedserve.server.config import ServerConfig
from pagedserve.server.dashboard import PAGE_FILES, KVStreamHub, add_dashboard_routes
from pagedserve.server.errors import APIError, bad_request, install_error_handlers, parse_body
from pagedserve.server.metrics import CONTENT_TYPE_LATEST, PrometheusStatLogger
from pagedserve.server.ollama import add_ollama_routes, ollama_error
from pagedserve.server.rerank import add_rerank_routes
from pagedserve.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, ModelCard,
                                        ModelList, TokenizeRequest)
from pagedserve.server.anthropic import add_anthropic_routes, anthropic_error
from pagedserve.server.embeddings import add_embedding_routes
from pagedserve.server.lora import ServerLoRAs, add_lora_routes, check_startup_adapters, lora_cards
from pagedserve.server.responses import add_responses_routes
from pagedserve.server.serving import ChatServing, CompletionServing, chat_prompt_ids
from pagedserve.server.state import DEFAULT_MODEL_NAME, ServerState, engine_exit_timeout

logger = logging.getLogger("pagedserve.server")

# Routes that answer without an API key and while the engine is not ready (the health checks
# answer 503 until it is: /ping is vLLM's SageMaker-style /health).
OPEN_PATHS = {"/health", "/ping", "/version", "/metrics"}
HEALTH_PATHS = {"/health", "/ping"}


def shaped_error(path: str, e: APIError) -> Response:
    """The error in the shape of the API the path belongs to (Ollama's, Anthropic's, else OpenAI's)."""
    if path.startswith("/api/"):
        return ollama_error(e)
    if path.startswith("/v1/messages"):
        return anthropic_error(e)
    return e.response()


class GateMiddleware:
    """503 while starting or shutting down, 401 without the API key, 413 for a body over
    max_request_body_bytes; counts the requests it lets in until they are answered (pure ASGI,
    so streaming responses and disconnects pass through untouched)."""

    def __init__(self, app, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            error = self._refuse(scope) or self._too_large(scope)
            if error is not None:
                self.state.log_refusal(scope["method"], scope["path"], error)
                await shaped_error(scope["path"], error)(scope, receive, send)
                return
            if self.state.max_request_body_bytes:
                receive = self._limited(receive, self.state.max_request_body_bytes)
            self.state.num_in_flight += 1
            try:
                await self._serve(scope, receive, send)
            finally:
                self.state.num_in_flight -= 1
            return
        await self.app(scope, receive, send)

    async def _serve(self, scope, receive, send) -> None:
        """Run the app until it answers, or until the shutdown's drain is over (state.hard_stop):
        then cancel it and answer 503 (OpenAI's shape; a stream already begun gets the error as
        its last event)."""
        started = finished = sse = False

        async def tracked_send(message) -> None:
            nonlocal started, finished, sse
            if message["type"] == "http.response.start":
                started = True
                sse = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                          for k, v in message.get("headers", ()))
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                finished = True
            await send(message)
        app_task = asyncio.ensure_future(self.app(scope, receive, tracked_send))
        stop_task = asyncio.ensure_future(self.state.hard_stop.wait())
        try:
            await asyncio.wait({app_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            app_task.cancel()
            raise
        finally:
            stop_task.cancel()
        if app_task.done():
            app_task.result()   # its exception, if any, goes to the servers' handlers as before
            return
        app_task.cancel()
        try:
            await app_task
        except BaseException:   # noqa: BLE001 - cancelled on purpose; nothing left to report
            pass
        if finished:
            return
        error = APIError(503, "the server is shutting down: the request could not be finished in time")
        if not started:
            await error.response(headers={"Connection": "close"})(scope, receive, send)
        else:
            body = f"data: {json.dumps(error.body())}\n\ndata: [DONE]\n\n".encode() if sse else b""
            await send({"type": "http.response.body", "body": body, "more_body": False})

    @staticmethod
    def _body_error(limit: int, size: str) -> APIError:
        return APIError(413, f"the request body is {size} bytes; the limit is {limit} (--max-request-body-bytes)",
                        code="request_too_large")

    def _too_large(self, scope) -> APIError | None:
        """Refuse at once when the declared Content-Length is over the limit."""
        limit = self.state.max_request_body_bytes
        length = dict(scope["headers"]).get(b"content-length")
        if limit and length is not None and (not length.isdigit() or int(length) > limit):
            return self._body_error(limit, length.decode("latin-1"))
        return None

    def _limited(self, receive, limit: int):
        """Count the body as it arrives (chunked bodies declare no length): past the limit,
        reading it raises a 413."""
        received = 0

        async def wrapped():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise self._body_error(limit, f"more than {limit}")
            return message
        return wrapped

    def _refuse(self, scope) -> APIError | None:
        state, path = self.state, scope["path"]
        if (path in OPEN_PATHS and path not in HEALTH_PATHS) or path in PAGE_FILES:
            return None
        if state.shutting_down:
            return APIError(503, "the server is shutting down")
        if not state.llm.ready:
            return APIError(503, f"the server is not ready: the engine is {state.llm.state}")
        if state.api_key and path not in OPEN_PATHS:
            headers = dict(scope["headers"])
            scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
            if scheme.lower() != "bearer":   # Anthropic's clients send the key as x-api-key
                token = headers.get(b"x-api-key", b"").decode("latin-1")
            if not hmac.compare_digest(token.encode(), state.api_key.encode()):
                return APIError(401, "missing or incorrect API key: send 'Authorization: Bearer <key>' (or "
                                     "'x-api-key: <key>')", code="invalid_api_key")
        return None


def add_process_routes(app: FastAPI, state: ServerState) -> None:
    """/health, /ping, /load and /version: the process's routes, the same on a one-model and a
    several-model server (server/multi.py)."""
    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        return Response(status_code=200)

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        return Response(status_code=200)

    @app.get("/load")
    async def load() -> dict:
        """vLLM's server load: the HTTP requests in flight (this one not counted)."""
        return {"server_load": max(state.num_in_flight - 1, 0)}

    @app.get("/version")
    async def version() -> dict:
        return {"version": pagedserve.__version__}


def build_app(state: ServerState, server: ServerConfig | None = None) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state.loop = asyncio.get_running_loop()
        if state.llm.state == "created":
            state.llm.start()
        state._tasks.append(asyncio.create_task(_watch_start(state)))
        state._tasks.append(asyncio.create_task(_watch_engine(state)))
        yield
        state.shutting_down = True
        for task in state._tasks:
            task.cancel()
        if "prompts" in state.__dict__:
            state.prompts.close()
        await state.llm.shutdown(timeout=engine_exit_timeout(state.llm, 5.0))

    no_docs = dict(docs_url=None, redoc_url=None, openapi_url=None) if server and server.disable_fastapi_docs else {}
    app = FastAPI(title="pagedserve", version=pagedserve.__version__, lifespan=lifespan, **no_docs)
    app.state.server = state
    app.add_middleware(GateMiddleware, state=state)
    if server is not None and server.allowed_origins:
        # Outside the gate: a browser's preflight (OPTIONS, no API key) is answered here, and
        # the gate's refusals carry the CORS headers too.
        app.add_middleware(CORSMiddleware, allow_origins=server.allowed_origins,
                           allow_methods=server.allowed_methods, allow_headers=server.allowed_headers,
                           allow_credentials=server.allow_credentials)
    install_error_handlers(app)

    add_process_routes(app, state)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        cards = [ModelCard(id=name, root=state.llm.model_path, max_model_len=state.llm.max_model_len)
                 for name in state.served_model_names]
        cards += lora_cards(state)
        return JSONResponse(ModelList(data=cards).model_dump())

    # Bodies are parsed here rather than by FastAPI so that any content type is read as JSON
    # (curl -d sends form encoding) and every parse error is a 400 in OpenAI's shape.
    @app.post("/v1/completions")
    async def completions(raw: Request):
        body = await parse_body(raw, CompletionRequest, state.prompts.precheck_completion_body)
        return await CompletionServing(state, body, raw).create()

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request):
        body = await parse_body(raw, ChatCompletionRequest, state.prompts.precheck_chat_body)
        return await ChatServing(state, body, raw).create()

    @app.post("/tokenize")
    async def tokenize(raw: Request) -> dict:
        body = await parse_body(raw, TokenizeRequest, state.prompts.precheck_chat_body)
        state.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give either prompt or messages", "prompt")
        if body.prompt is not None:
            (ids,) = await state.prompts.encode([body.prompt], add_special_tokens=body.add_special_tokens)
        else:
            ids = await state.prompts.render_chat(chat_prompt_ids, body.messages, body.add_generation_prompt)
        out = {"count": len(ids), "max_model_len": state.llm.max_model_len, "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = await state.prompts.run(state.llm.tokenizer.convert_ids_to_tokens, ids)
        return out

    @app.post("/detokenize")
    async def detokenize(raw: Request) -> dict:
        body = await parse_body(raw, DetokenizeRequest, state.prompts.precheck_detokenize_body)
        state.check_model(body.model)
        if len(body.tokens) > state.llm.max_model_len:
            raise bad_request(f"at most {state.llm.max_model_len} token ids (this model's context) are detokenized "
                              f"at once; got {len(body.tokens)}", "tokens")
        vocab = state.llm.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"token ids out of the vocabulary (size {vocab}): {bad[:5]}", "tokens")
        return {"prompt": await state.prompts.run(state.llm.tokenizer.decode, body.tokens)}   # off the event loop

    add_lora_routes(app, state)
    add_responses_routes(app, state)
    add_embedding_routes(app, state)
    add_ollama_routes(app, state)
    add_anthropic_routes(app, state)
    add_rerank_routes(app, state)
    hub = KVStreamHub(state.llm, state.kv_snapshot_interval, run=lambda fn, *args: state.prompts.run(fn, *args))
    state.on_shutdown.append(hub.close)   # open pages would otherwise hold the drain to its timeout
    add_dashboard_routes(app, hub)
    return app


async def _watch_start(state: ServerState) -> None:
    try:
        await state.llm.wait_started()
    except BaseException as e:   # noqa: BLE001
        logger.error("the engine failed to start (%s: %s); stopping the server", type(e).__name__, e)
        state.on_start_failed()
        return
    if state.loras is not None:
        await check_startup_adapters(state)
    logger.info("ready to serve %s", ", ".join(state.served_model_names + (list(state.loras.adapters) if state.loras
                                                                             else [])))


async def _watch_engine(state: ServerState) -> None:
    error = await state.llm.wait_dead()
    logger.critical("%s; /health answers 503 and the server exits with status 1", error)
    state.on_engine_dead()


class _Server(uvicorn.Server):
    """uvicorn, plus: the first signal starts our drain (503s while the requests in flight
    finish, then aborts) and only then stops uvicorn, which would otherwise stop listening at
    once (new clients would be refused a connection, not answered 503); a second signal, or
    one before the app has started, stops uvicorn at once. A clean shutdown exits 0 (uvicorn
    would re-raise the signal once done, ending the process with 128+SIGTERM)."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self._draining = False

    def handle_exit(self, sig, frame) -> None:
        if self._draining or self.state.loop is None:
            super().handle_exit(sig, frame)
        else:
            self._draining = True
            self.state.loop.call_soon_threadsafe(self.state.begin_shutdown, self.stop)
        captured = getattr(self, "_captured_signals", None)
        if isinstance(captured, list):
            captured.clear()

    def stop(self) -> None:
        self.should_exit = True


def make_engine_client(config: EngineConfig, s: ServerConfig) -> tuple[EngineClient, PrometheusStatLogger]:
    """One AsyncLLM, or with data_parallel_size > 1 the replicas behind a router (same calls)."""
    names = s.served_model_name or [config.model or DEFAULT_MODEL_NAME]
    log_interval = None if s.disable_log_stats else s.log_stats_interval
    if config.structured_outputs_warmup is None:
        config.structured_outputs_warmup = server_grammar_warmup()
    if s.data_parallel_size == 1:
        metrics = PrometheusStatLogger(names[0], prefix=s.metrics_prefix)
        return AsyncLLM(config, [metrics], log_interval=log_interval,
                        max_waiting_requests=s.max_waiting_requests), metrics
    from pagedserve.cluster.client import DataParallelLLM
    metrics = PrometheusStatLogger(names[0], num_engines=s.data_parallel_size, prefix=s.metrics_prefix)
    return DataParallelLLM(config, s.data_parallel_size, metrics, s.routing_policy, s.ray_address,
                           max_waiting_requests=s.max_waiting_requests, log_interval=log_interval), metrics


def server_state(config: EngineConfig, s: ServerConfig, llm: EngineClient, metrics: PrometheusStatLogger,
                 **overrides) -> ServerState:
    """The state the routes of one model share (a multi-model server makes one per loaded model)."""
    names = s.served_model_name or [config.model or DEFAULT_MODEL_NAME]
    kw = dict(api_key=s.api_key, shutdown_timeout=s.shutdown_timeout,
              max_request_body_bytes=s.max_request_body_bytes if s.max_request_body_bytes and
              s.max_request_body_bytes > 0 else None, log_requests=not s.disable_log_requests,
              enable_auto_tool_choice=s.enable_auto_tool_choice, tool_call_parser=s.tool_call_parser,
              reasoning_parser=s.reasoning_parser,
              kv_snapshot_interval=s.kv_snapshot_interval, options=s, pooling=config.is_pooling,
              loras=ServerLoRAs(s.lora_modules) if config.enable_lora else None)
    return ServerState(llm, names, metrics, **{**kw, **overrides})


def run_server(config: EngineConfig, server: ServerConfig | None = None) -> int:
    """Serve until SIGTERM/SIGINT; returns the exit status (1 if the model failed to load).
    A limit of None or <= 0 turns it off."""
    s = server or ServerConfig()
    llm, metrics = make_engine_client(config, s)
    state = server_state(config, s, llm, metrics)
    app = build_app(state, s)
    uv_config = uvicorn.Config(app, host=s.host, port=s.port, log_level=s.uvicorn_log_level,
                               access_log=not s.disable_uvicorn_access_log,
                               timeout_graceful_shutdown=int(s.shutdown_timeout) + 5)
    uv_server = _Server(uv_config, state)

    state.on_start_failed = uv_server.stop
    state.on_engine_dead = uv_server.stop
    ray_connected = False
    # Ray is joined on the main thread before uvicorn installs its signal handlers: Ray's own
    # SIGTERM handler (abseil's) would otherwise run first and abort the process 3 s into the drain.
    if s.data_parallel_size > 1:
        from pagedserve.cluster.client import init_ray
        ray_connected = init_ray(s.ray_address)
    try:
        uv_server.run()
    finally:
        if ray_connected:
            import ray
            ray.shutdown()
    return 1 if llm.state in ("failed", "dead") or not uv_server.started else 0
