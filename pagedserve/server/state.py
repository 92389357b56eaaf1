"""What the server's routes share: the engine, served names, limits, and the shutdown drain.

Its own module so that the routes (app.py) and the request handlers (serving.py) both
import it without importing each other.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable

from pagedserve.engine.protocol import EngineClient
from pagedserve.models.resolve import DEFAULT_HUB_ID
from pagedserve.server import DEFAULT_MAX_REQUEST_BODY_BYTES
from pagedserve.server.config import ServerConfig
from pagedserve.server.errors import APIError
from pagedserve.server.metrics import PrometheusStatLogger
from pagedserve.server.prompts import PromptProcessor

logger = logging.getLogger("pagedserve.server")

DEFAULT_MODEL_NAME = DEFAULT_HUB_ID     # the default model's Hub id (it resolves to the bundled file offline)
TIER_SAVE_TIMEOUT_S = 300.0             # at shutdown, for the engine thread's save of the pool to the disk tier


def engine_exit_timeout(llm: EngineClient, timeout: float) -> float:
    """How long to wait for an engine's way out: `timeout` (a step is short; never hold the exit long),
    longer where the engine saves its pool's cached blocks to the disk tier (the exit would drop the rest)."""
    return max(timeout, TIER_SAVE_TIMEOUT_S) if llm.config.kv_offload_path else timeout


@dataclass
class ServerState:
    llm: EngineClient                   # AsyncLLM, or DataParallelLLM (engine/protocol.py)
    served_model_names: list[str]
    metrics: PrometheusStatLogger
    api_key: str | None = None
    shutdown_timeout: float = 5.0
    max_request_body_bytes: int | None = DEFAULT_MAX_REQUEST_BODY_BYTES
    log_requests: bool = True           # a log line per request and per refusal (--disable-log-requests)
    # Tool calling: tool_choice "auto" needs both (server/tools.py).
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None   # server/reasoning.py: <think> blocks as reasoning_content
    kv_snapshot_interval: float = 0.5   # seconds between the dashboard's KV snapshots (server/dashboard.py)
    # The rest of the server's settings (response_role, the responses store, ...), and whether the
    # engine is a pooling one (embeddings only: runner pooling).
    options: ServerConfig = field(default_factory=ServerConfig)
    pooling: bool = False
    loras: Any = None                   # server/lora.py ServerLoRAs: adapters by name (--enable-lora)
    shutting_down: bool = False
    num_in_flight: int = 0              # HTTP requests let in and not answered yet (streams included)
    on_start_failed: Callable[[], None] = lambda: None
    on_engine_dead: Callable[[], None] = lambda: None
    on_shutdown: list[Callable[[], None]] = field(default_factory=list)   # e.g. end the dashboard's streams
    loop: asyncio.AbstractEventLoop | None = None
    # Set when the drain is over: the gate answers whatever is still in flight with a 503 itself.
    hard_stop: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list[Any] = field(default_factory=list)

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    @cached_property
    def prompts(self) -> PromptProcessor:
        """Built on first use, once the engine is ready (the routes that use it need it ready)."""
        return PromptProcessor(self.llm.tokenizer, self.llm.max_model_len, self.llm.check_num_prompts,
                               self.llm.max_waiting_requests)

    def check_model(self, name: str | None) -> str:
        """The name responses carry: the base model's, or the LoRA adapter's the request names."""
        if name is not None and self.loras is not None and name in self.loras.adapters:
            return name
        if name is not None and name not in self.served_model_names:
            adapters = list(self.loras.adapters) if self.loras is not None else []
            raise APIError(404, f"the model {name!r} does not exist; this server serves "
                                f"{', '.join(map(repr, self.served_model_names + adapters))}", "model",
                           "model_not_found")
        return self.model_name

    def lora_request(self, name: str | None):
        """The LoRARequest of the adapter a request's `model` names (None: the base model)."""
        return self.loras.adapters.get(name) if self.loras is not None and name is not None else None

    def log_refusal(self, method: str, path: str, error: APIError) -> None:
        if self.log_requests and 400 <= error.status < 500:
            logger.info("refused %s %s: %d %s%s", method, path, error.status, error.message,
                        f" (param {error.param})" if error.param else "")

    def begin_shutdown(self, stop_server: Callable[[], None]) -> None:
        """Refuse new requests (503) while the ones in flight finish, for up to shutdown_timeout
        seconds; then abort what is left and stop the server (call on the event loop)."""
        if self.shutting_down:
            return
        self.shutting_down = True
        for hook in self.on_shutdown:
            hook()
        logger.info("shutting down: new requests get 503, requests in flight have %.1f s to finish",
                    self.shutdown_timeout)
        self._tasks.append(asyncio.ensure_future(self._drain(stop_server)))

    async def _drain(self, stop_server: Callable[[], None]) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.shutdown_timeout
        while self.num_in_flight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.num_in_flight:
            logger.info("aborting %d requests still in flight", self.num_in_flight)
        self.llm.abort_all()
        # Aborted engine requests answer their clients (503) at once; a request still before the
        # engine (tokenizing, a grammar's checks) is answered 503 by the gate (app.py), so no
        # client waits for uvicorn's own timeout and its plain-text 500.
        await self._wait_idle(0.5)
        if self.num_in_flight:
            logger.info("answering %d requests still in flight with 503", self.num_in_flight)
        self.hard_stop.set()
        await self._wait_idle(0.5)
        stop_server()

    async def _wait_idle(self, seconds: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while self.num_in_flight and loop.time() < deadline:
            await asyncio.sleep(0.02)
