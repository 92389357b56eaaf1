"""EngineClient: what the server asks of an engine, in one place.

Two classes implement it: `AsyncLLM` (one engine on a thread of this process) and
`cluster/client.py`'s `DataParallelLLM` (N replicas behind a router). The server's routes are
typed against this Protocol only, so they cannot tell which one they hold, and neither class
needs to know the server. The stat logger a client reports to is passed in by whoever builds
it (the server builds its Prometheus logger), so no arrow points from the engine back up.
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol, runtime_checkable

from pagedserve.config import EngineConfig
from pagedserve.engine.kv_view import EngineCapture
from pagedserve.engine.stats import IterationStats, SchedulerStats
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import BeamSearchParams, SamplingParams

Params = SamplingParams | BeamSearchParams


class QueueFullError(RuntimeError):
    """Requests already wait up to the limit (the engine's queue, or a tokenizer lane in front
    of it): try again later (the server's 503 with Retry-After)."""


def check_num_prompts(num_new: int, max_waiting_requests: int | None) -> None:
    """ValueError if one call's prompts could never be queued whole (every client's check)."""
    if max_waiting_requests is not None and num_new > max_waiting_requests:
        raise ValueError(f"{num_new} prompts in one request; the server queues at most {max_waiting_requests} "
                         f"(--max-waiting-requests)")


class OutputStream(Protocol):
    """One caller's requests' outputs, as they come (AsyncLLM's RequestStream)."""
    request_ids: list[str]

    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...

    def abort(self) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class EngineClient(Protocol):
    """The engine as the server sees it. The attributes are set once the client is ready."""
    config: EngineConfig
    state: str                      # created | starting | ready | failed | stopped | dead
    tokenizer: Any                  # the front end's tokenizer (prompts, chat templates, /tokenize)
    max_model_len: int
    vocab_size: int
    model_path: str
    num_blocks: int
    default_sampling: dict          # the model's sampling defaults (generation config)
    max_waiting_requests: int | None

    @property
    def ready(self) -> bool: ...

    def start(self) -> None: ...

    async def wait_started(self) -> None: ...

    async def wait_dead(self) -> BaseException: ...

    async def shutdown(self, timeout: float = 30.0) -> None: ...

    def check_num_prompts(self, num_new: int) -> None: ...

    async def add_requests(self, items: list[tuple[str, Any, Params]],
                           arrival_time: float | None = None) -> OutputStream: ...

    def abort(self, request_ids: list[str]) -> None: ...

    def abort_all(self) -> None: ...

    async def kv_capture(self) -> EngineCapture: ...


class EngineStatLogger(Protocol):
    """What a data-parallel client reports its replicas' stats to (the server's
    PrometheusStatLogger): per-engine series, and a registry for the router's own metrics."""
    registry: Any
    model_name: str
    prefix: str
    engines: list[Any]              # per engine: restart() when a replica comes back fresh

    def record_engine(self, engine: int, s: SchedulerStats, it: IterationStats | None) -> None: ...
