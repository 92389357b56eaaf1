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
  step's iteration stats (for /metrics), and this incarnation's id (a restarted actor has
  a new one, and an empty cache).
"""
from __future__ import annotations

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
class _StatsBuffer:
    """A stat logger (engine thread) whose records wait for the next poll (actor's loop);
    list.append and swapping the attribute are atomic under the GIL."""
    latest: SchedulerStats | None = None
    iterations: list[IterationStats] = field(default_factory=list)

    def record(self, s: SchedulerStats, it: IterationStats | None) -> None:
        self.latest = s
        if it is not None and not it.empty:
            self.iterations.append(it)

    def take(self) -> tuple[SchedulerStats | None, list[IterationStats]]:
        iterations, self.iterations = self.iterations, []
        return self.latest, iterations


@dataclass
class ReplicaInfo:
    incarnation: str
    model_path: str
    max_model_len: int
    vocab_size: int
    num_blocks: int
    block_size: int


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
        self.events = KVEventLog()
        self.stats = _StatsBuffer()
        self.llm = AsyncLLM(config, [self.stats], log_interval=log_interval,
                            max_waiting_requests=max_waiting_requests, kv_events=self.events)

    async def start(self) -> ReplicaInfo:
        if self.llm.state == "created":
            self.llm.start()
        await self.llm.wait_started()
        llm = self.llm
        return ReplicaInfo(self.incarnation, llm.model_path, llm.max_model_len, llm.vocab_size, llm.num_blocks,
                           llm.config.block_size)

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
        stats, iterations = self.stats.take()
        return PollResult(self.incarnation, self.llm.state, self.events.drain(), stats, iterations)

    def cached_block_keys(self) -> set[bytes]:
        """The keys in this engine's prefix cache now (tests compare the router's index)."""
        return set(self.llm.engine.scheduler.kv.pool.cached)

    async def shutdown(self) -> None:
        await self.llm.shutdown()
