"""Several models behind one server: each loaded model has its own engine client (AsyncLLM, its
own KV cache), ServerState and routes (app.py's build_app); `ModelManager` loads them on demand and
unloads them when idle.

A model's life: unloaded -> loading -> loaded -> unloading -> unloaded (or failed, when its load
raised: the error is kept for /v1/models and the next request tries again; a load refused for room,
`NoRoom`, leaves it unloaded and answers 503 with Retry-After). A request leases its
model (`acquire`) for as long as it is answered, a stream to its end; `release` sets the model's
keep-alive from the request's `keep_alive` (Ollama's semantics: the last request's wins) or the
server's --keep-alive, and once no request holds it a timer unloads it after that time. Loads run
one at a time (`_load_lock`): before one, the least recently used idle models are unloaded while
the loaded ones number --max-loaded-models, or while the process's memory plus the new model's
estimate would pass --max-memory; a load that cannot make room is refused with a 503. Unloading
waits for the model's leases to end (its requests in flight finish); requests that arrive
meanwhile wait for it and then load it again. Other models serve throughout: loads and unloads run
on the engine's own thread and `asyncio.to_thread`.

To the server's top-level state the manager stands where a single model's engine client would
(`ready`, `start`, `shutdown`, `abort_all`: the gate and the shutdown drain call them).
"""
from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from pagedserve.config import EngineConfig
from pagedserve.engine.protocol import EngineClient
from pagedserve.server.config import ServerConfig
from pagedserve.server.errors import RETRY_AFTER_S, APIError
from pagedserve.server.model_specs import ModelSpec, parse_duration, parse_memory, rss_bytes
from pagedserve.server.state import ServerState, engine_exit_timeout

logger = logging.getLogger("pagedserve.server")

DEFAULT_KV_BYTES = 2 * 1024**3      # the engine's CPU default when kv_cache_memory is unset


class NoRoom(APIError):
    """A load refused for capacity (every loaded model busy, or --max-memory): a 503 with
    Retry-After; the model stays unloaded and the next request for it tries again."""

    def __init__(self, message: str) -> None:
        super().__init__(503, message, "model", "model_capacity", headers={"Retry-After": str(RETRY_AFTER_S)})


@dataclass
class LoadedModel:
    llm: EngineClient
    state: ServerState                  # the model's own: its routes read it
    app: Any                            # its routes (an ASGI app: build_app over `state`)
    memory_bytes: int                   # the process's resident memory grown by its load


@dataclass
class ModelEntry:
    spec: ModelSpec
    config: EngineConfig                # its engine settings (checked at startup)
    server: ServerConfig                # its server settings
    default_keep_alive: float           # seconds (math.inf: forever)
    status: str = "unloaded"            # unloaded | loading | loaded | unloading | failed
    loaded: LoadedModel | None = None
    error: str | None = None            # the last load's failure
    progress: str = ""                  # what a load is doing now
    leases: int = 0                     # requests being answered
    waiting: int = 0                    # requests waiting for it to load
    last_used: float = 0.0              # monotonic
    keep_alive: float = 0.0
    expires_at: float | None = None     # wall clock, while idle (None: never)
    load_seconds: float | None = None
    loads: int = 0
    task: asyncio.Future | None = None  # the load or unload in progress
    timer: asyncio.TimerHandle | None = None
    idle: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def name(self) -> str:
        return self.spec.name

    def estimate_bytes(self) -> int:
        """What a load will add: its measured growth last time, else its weight files plus its KV cache."""
        if self.loaded is None and self.load_bytes:
            return self.load_bytes
        return self.spec.weight_bytes() + (self.config.kv_cache_memory or DEFAULT_KV_BYTES)

    load_bytes: int = 0


def _malloc_trim() -> None:
    """Hand freed heap pages back to the OS (glibc keeps them otherwise: RSS would not fall)."""
    name = ctypes.util.find_library("c")
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError, TypeError):
        pass


class ModelManager:
    """The models of a multi-model server, by name; see the module's docstring."""

    def __init__(self, specs: list[ModelSpec], base: EngineConfig, server: ServerConfig,
                 start_model: Callable[["ModelEntry"], Any]) -> None:
        """`start_model(entry)`: an awaitable LoadedModel (the server's: builds the engine client,
        waits for its start, builds its routes)."""
        self.server = server
        self.default_keep_alive = parse_duration(server.keep_alive)
        self.max_loaded = server.max_loaded_models if server.max_loaded_models > 0 else None
        self.max_memory = parse_memory(server.max_memory)
        self.entries: dict[str, ModelEntry] = {}
        for spec in specs:
            config = spec.engine_config(base)
            keep = parse_duration(spec.server["keep_alive"]) if "keep_alive" in spec.server else self.default_keep_alive
            entry = ModelEntry(spec, config, spec.server_config(server), keep, keep_alive=keep)
            entry.idle.set()
            self.entries[spec.name] = entry
        self.aliases: dict[str, str] = {}       # LoRA adapter name -> its base model
        for entry in self.entries.values():
            for text in entry.server.lora_modules or ():
                from pagedserve.server.lora import parse_lora_module
                self.aliases[parse_lora_module(text)[0]] = entry.name
        self._start_model = start_model
        self._load_lock = asyncio.Lock()
        self.shutting_down = False
        self.state = "created"              # the engine-client face (see the module's docstring)

    # ---- names ----------------------------------------------------------------------------------
    @property
    def default_name(self) -> str:
        return next(iter(self.entries))

    def resolve(self, name: str | None) -> ModelEntry:
        """The model a request's `model` names: a model, a LoRA adapter's base, Ollama's NAME:latest;
        no name: the first model. 404 otherwise."""
        if name is None or name == "":
            return self.entries[self.default_name]
        for candidate in (name, name.removesuffix(":latest")):
            if candidate in self.entries:
                return self.entries[candidate]
            if candidate in self.aliases:
                return self.entries[self.aliases[candidate]]
        for entry in self.entries.values():   # an adapter loaded at run time (/v1/load_lora_adapter)
            loras = entry.loaded.state.loras if entry.loaded is not None else None
            if loras is not None and name in loras.adapters:
                return entry
        raise APIError(404, f"the model {name!r} does not exist; this server serves "
                            f"{', '.join(map(repr, list(self.entries) + list(self.aliases)))}", "model",
                       "model_not_found")

    # ---- requests -------------------------------------------------------------------------------
    async def acquire(self, name: str | None) -> ModelEntry:
        """The model, loaded, leased to the caller until `release` (loading it first if needed)."""
        entry = self.resolve(name)
        entry.waiting += 1
        try:
            while True:
                if self.shutting_down:
                    raise APIError(503, "the server is shutting down")
                if entry.status == "loaded":
                    entry.leases += 1
                    entry.idle.clear()
                    entry.last_used = time.monotonic()
                    self._cancel_timer(entry)
                    return entry
                if entry.status in ("unloaded", "failed"):
                    entry.status, entry.error = "loading", None
                    entry.task = asyncio.ensure_future(self._load(entry))
                task = entry.task
                try:
                    await asyncio.shield(task)
                except NoRoom:
                    raise   # every request waiting for this load hears it: 503, retry later
                except APIError:
                    if entry.status == "failed":
                        raise
                except Exception:   # noqa: BLE001 - the load's own failure is reported as entry.error
                    raise APIError(500, f"the model {entry.name!r} failed to load: {entry.error}",
                                   "model", "model_load_failed") from None
        finally:
            entry.waiting -= 1

    def release(self, entry: ModelEntry, keep_alive: float | None = None) -> None:
        """A request is answered: the model's keep-alive is now `keep_alive` (seconds) or its
        default; once idle, a timer unloads it after that."""
        entry.leases -= 1
        entry.last_used = time.monotonic()
        entry.keep_alive = entry.default_keep_alive if keep_alive is None else keep_alive
        if entry.leases == 0:
            entry.idle.set()
            self._arm_timer(entry)

    def _arm_timer(self, entry: ModelEntry) -> None:
        self._cancel_timer(entry)
        if entry.status != "loaded" or entry.leases or math.isinf(entry.keep_alive):
            return
        entry.expires_at = time.time() + entry.keep_alive
        entry.timer = asyncio.get_running_loop().call_later(entry.keep_alive, self._expire, entry)

    @staticmethod
    def _cancel_timer(entry: ModelEntry) -> None:
        if entry.timer is not None:
            entry.timer.cancel()
            entry.timer = None
        entry.expires_at = None

    def _expire(self, entry: ModelEntry) -> None:
        entry.timer = None
        if entry.status == "loaded" and entry.leases == 0 and entry.waiting == 0:
            asyncio.ensure_future(self.unload(entry.name, f"idle for its keep_alive ({entry.keep_alive:g} s)"))

    # ---- load and unload ------------------------------------------------------------------------
    async def load(self, name: str) -> ModelEntry:
        """Load it (if it is not) and keep it for its keep-alive: /models/load."""
        entry = await self.acquire(name)
        self.release(entry)
        return entry

    async def _load(self, entry: ModelEntry) -> None:
        async with self._load_lock:
            try:
                await self._make_room(entry)
                started, before = time.monotonic(), rss_bytes()
                entry.progress = "loading the weights and sizing the KV cache"
                logger.info("loading model %s from %s", entry.name, entry.spec.path)
                loaded = await self._start_model(entry)
                loaded.memory_bytes = max(rss_bytes() - before, 0)
            except NoRoom as e:   # nothing wrong with the model: it stays unloaded, a later request tries again
                entry.status, entry.progress = "unloaded", ""
                logger.warning("model %s was not loaded: %s", entry.name, e.message)
                raise
            except APIError as e:
                entry.status, entry.error, entry.progress = "failed", e.message, ""
                logger.error("model %s was not loaded: %s", entry.name, e.message)
                raise
            except BaseException as e:   # noqa: BLE001 - any failure of a load leaves the others serving
                entry.status, entry.error, entry.progress = "failed", f"{type(e).__name__}: {e}", ""
                logger.error("model %s failed to load: %s", entry.name, entry.error)
                raise
            entry.loaded, entry.status, entry.progress = loaded, "loaded", ""
            entry.load_bytes = loaded.memory_bytes or entry.load_bytes
            entry.load_seconds = time.monotonic() - started
            entry.loads += 1
            entry.last_used = time.monotonic()
            logger.info("model %s loaded in %.1f s (+%.0f MiB resident)", entry.name, entry.load_seconds,
                        loaded.memory_bytes / 2**20)

    def _room_problem(self, entry: ModelEntry) -> str | None:
        loaded = [e for e in self.entries.values() if e.status in ("loaded", "unloading") and e is not entry]
        if self.max_loaded is not None and len(loaded) + 1 > self.max_loaded:
            return f"{len(loaded)} models are loaded and at most {self.max_loaded} may be (--max-loaded-models)"
        if self.max_memory is not None:
            need, used = entry.estimate_bytes(), rss_bytes()
            if used + need > self.max_memory:
                return (f"the process uses {used / 2**30:.2f} GiB and the model needs about {need / 2**30:.2f} GiB; "
                        f"--max-memory is {self.max_memory / 2**30:.2f} GiB")
        return None

    async def _make_room(self, entry: ModelEntry) -> None:
        """Unload least recently used idle models until `entry` fits; 503 if it cannot."""
        while (problem := self._room_problem(entry)) is not None:
            unloading = [e.task for e in self.entries.values() if e.status == "unloading" and e.task is not None]
            if unloading:
                await asyncio.gather(*(asyncio.shield(t) for t in unloading), return_exceptions=True)
                continue
            idle = [e for e in self.entries.values()
                    if e.status == "loaded" and e is not entry and e.leases == 0 and e.waiting == 0]
            if not idle:
                raise NoRoom(f"cannot load the model {entry.name!r}: {problem}, and no loaded model is idle to "
                             f"unload; retry later")
            victim = min(idle, key=lambda e: e.last_used)
            entry.progress = f"unloading {victim.name} to make room"
            await self.unload(victim.name, f"least recently used, to make room for {entry.name} ({problem})")

    async def unload(self, name: str, reason: str = "asked to") -> ModelEntry:
        """Unload it once its requests in flight are answered (/models/unload, keep-alive, room)."""
        entry = self.resolve(name)
        if entry.status == "loaded":
            entry.status = "unloading"
            self._cancel_timer(entry)
            entry.task = asyncio.ensure_future(self._unload(entry, reason))
        if entry.status in ("unloading", "loading") and entry.task is not None:
            await asyncio.gather(asyncio.shield(entry.task), return_exceptions=True)
        return entry

    async def _unload(self, entry: ModelEntry, reason: str) -> None:
        logger.info("unloading model %s (%s)%s", entry.name, reason,
                    f"; waiting for its {entry.leases} request(s) in flight" if entry.leases else "")
        await entry.idle.wait()
        loaded, entry.loaded = entry.loaded, None
        before = rss_bytes()
        try:
            for hook in loaded.state.on_shutdown:
                hook()
            await loaded.llm.shutdown(timeout=engine_exit_timeout(loaded.llm, 30.0))
            if "prompts" in loaded.state.__dict__:
                loaded.state.prompts.close()
        except Exception:   # noqa: BLE001 - the model goes whatever its engine said
            logger.exception("model %s: its engine did not stop cleanly", entry.name)
        _forget_engine(loaded.state)
        del loaded
        await asyncio.to_thread(_collect)
        entry.status, entry.task = "unloaded", None
        logger.info("model %s unloaded (%.0f MiB resident freed)", entry.name, max(before - rss_bytes(), 0) / 2**20)

    # ---- the engine-client face for the top-level state -----------------------------------------
    @property
    def ready(self) -> bool:
        return self.state == "ready"

    def start(self) -> None:
        self.state = "ready"

    async def wait_started(self) -> None:
        return None

    async def wait_dead(self) -> BaseException:
        await asyncio.Event().wait()      # a model that dies is that model's failure, not the server's
        raise AssertionError("unreachable")

    def abort_all(self) -> None:
        for entry in self.entries.values():
            if entry.loaded is not None:
                entry.loaded.llm.abort_all()

    async def shutdown(self, timeout: float = 30.0) -> None:
        self.shutting_down = True
        for entry in self.entries.values():
            self._cancel_timer(entry)
            if entry.loaded is not None:
                await entry.loaded.llm.shutdown(engine_exit_timeout(entry.loaded.llm, timeout))
        self.state = "stopped"


class _UnloadedEngine:
    """What an unloaded model's old routes see in place of its engine client."""
    state = "stopped"
    ready = False
    tokenizer = None


def _forget_engine(state: ServerState) -> None:
    """Drop every reference the model's routes hold to its engine and tokenizer. FastAPI keeps
    each app's endpoint functions in module-level caches (its dependency analysis), so an old
    app, and the ServerState its closures hold, outlive the model: they must not hold the engine."""
    gone = _UnloadedEngine()
    state.llm = gone   # type: ignore[assignment]
    state.__dict__.pop("prompts", None)
    for hook in state.on_shutdown:   # the dashboard's KVStreamHub.close: the hub holds the engine too
        owner = getattr(hook, "__self__", None)
        if owner is not None and hasattr(owner, "llm"):
            owner.llm = gone
    state.on_shutdown.clear()
    state.loras = state.metrics = None   # type: ignore[assignment] - the stale state stays small


def _collect() -> None:
    gc.collect()
    _malloc_trim()
