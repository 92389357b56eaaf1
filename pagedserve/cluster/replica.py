"""One data-parallel engine replica: an AsyncLLM inside a Ray actor (its own process,
possibly on another node).

The server's client (client.py) talks to it through Ray calls only:
- `start()` loads the model and returns what the front end needs to know of it;
- `generate(...)`, an async generator method (a Ray streaming generator), first yields
  ("added", None) or ("error", ...) for the add, then ("output", RequestOutput) as the
  engine produces them, so tokens flow back as they are made;
- `abort`, `abort_all`;
- `poll()` hands over what happened since the last poll: the prefix cache's KV events (in
  order: the router's index replays them exactly), the latest scheduler stats and every
  step's iteration stats (for /metrics), both as of the engine's last published step, and
  this incarnation's id (a restarted actor has a new one, and an empty cache).
"""
from __future__ import annotations

import threading
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pagedserve.config import EngineConfig
from pagedserve.engine.async_llm import (AsyncLLM, EngineDeadError, EngineNotReadyError, EngineStepError,
                                         QueueFullError)
from pagedserve.engine.stats import IterationStats, SchedulerStats
from pagedserve.errors import InvalidRequestError
from pagedserve.kv.events import KVEvent, KVEventLog

# Errors that cross the process boundary as (kind, message, param, code) and are raised again
# as the same class on the server's side (exceptions with extra fields do not all pickle back).
ERROR_KINDS = {"invalid": InvalidRequestError, "queue_full": QueueFullError, "not_ready": EngineNotReadyError,
               "dead": EngineDeadError, "step": EngineStepError, "value": ValueError}


def describe_error(e: BaseException) -> tuple[str, str, str | None, str | None]:
    for kind, cls in ERROR_KINDS.items():   # most specific first: InvalidRequestError is a ValueError
        if isinstance(e, cls):
            if isinstance(e, InvalidRequestError):
                return kind, e.message, e.param, e.code
            return kind, str(e), None, None
    return "step", repr(e), None, None


def rebuild_error(kind: str, message: str, param: str | None, code: str | None) -> BaseException:
    if kind == "invalid":
        return InvalidRequestError(message, param, code)
    return ERROR_KINDS[kind](message)


@dataclass
class _Published:
    """A stat logger (called on the engine thread after every step, add and abort) that also
    moves the KV events of that step out of the event log: a poll (the actor's loop) then gets
    the events and the stats of the same moment, so the router's index and /metrics never
    disagree about what the replica has done."""
    kv_events: KVEventLog
    latest: SchedulerStats | None = None
    iterations: list[IterationStats] = field(default_factory=list)
    events: list[KVEvent] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, s: SchedulerStats, it: IterationStats | None) -> None:
        with self.lock:
            self.events += self.kv_events.drain()
            self.latest = s
            if it is not None and not it.empty:
                self.iterations.append(it)

    def take(self) -> tuple[list[KVEvent], SchedulerStats | None, list[IterationStats]]:
        with self.lock:
            events, self.events = self.events, []
            iterations, self.iterations = self.iterations, []
            return events, self.latest, iterations


@dataclass
class ReplicaInfo:
    incarnation: str
    model_path: str
    max_model_len: int
    vocab_size: int
    num_blocks: int
    block_size: int
    default_sampling: dict    # the model's sampling defaults (LLMEngine.default_sampling)


@dataclass
class PollResult:
    incarnation: str
    state: str
    events: list[KVEvent]
    stats: SchedulerStats | None
    iterations: list[IterationStats]


class EngineReplica:
    """The actor's class (client.py wraps it with ray.remote)."""

    def __init__(self, config: EngineConfig, max_waiting_requests: int | None = None,
                 log_interval: float | None = None) -> None:
        self.incarnation = uuid.uuid4().hex
        events = KVEventLog()
        self.published = _Published(events)
        self.llm = AsyncLLM(config, [self.published], log_interval=log_interval,
                            max_waiting_requests=max_waiting_requests, kv_events=events)

    async def start(self) -> ReplicaInfo:
        if self.llm.state == "created":
            self.llm.start()
        await self.llm.wait_started()
        llm = self.llm
        return ReplicaInfo(self.incarnation, llm.model_path, llm.max_model_len, llm.vocab_size, llm.num_blocks,
                           llm.config.block_size, llm.default_sampling)

    async def generate(self, request_id: str, prompt, params, arrival_time: float | None = None) -> AsyncIterator:
        try:
            stream = await self.llm.add_requests([(request_id, prompt, params)], arrival_time)
        except Exception as e:   # noqa: BLE001 - handed back to the caller
            yield ("error", describe_error(e))
            return
        yield ("added", None)
        try:
            async for out in stream:
                yield ("output", out)
        except Exception as e:   # noqa: BLE001
            yield ("error", describe_error(e))
        finally:
            stream.close()

    def abort(self, request_ids: list[str]) -> None:
        self.llm.abort(request_ids)

    def abort_all(self) -> None:
        self.llm.abort_all()

    def poll(self) -> PollResult:
        events, stats, iterations = self.published.take()
        return PollResult(self.incarnation, self.llm.state, events, stats, iterations)

    def cached_block_keys(self) -> set[bytes]:
        """The keys in this engine's prefix cache now (tests compare the router's index; read
        while the engine is idle)."""
        return set(self.llm.engine.scheduler.kv.pool.cached)

    async def shutdown(self) -> None:
        await self.llm.shutdown()
