"""DataParallelLLM: N engine replicas (Ray actors, replica.py) behind one Router, with the
calls the server makes of an AsyncLLM, so the routes do not know which they have.

Each engine request is routed on its own (a completion with several prompts may use
several replicas) and streamed back through its replica's streaming generator. A monitor
task per replica polls it (`poll`, every POLL_INTERVAL s): its KV events go into the
router's index, its stats into the /metrics series labelled engine="i".

Faults: a replica that dies fails only the requests it was running (EngineStepError,
a 500 naming the replica); a request whose add had not reached it is routed again to
another live replica. The monitor marks the replica down (its index is emptied), waits
for Ray to restart the actor (`max_restarts`), starts its engine and lets it rejoin the
routing. The client is dead (/health 503) only when no replica can come back.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
import time
import uuid
from typing import Any

from prometheus_client import Counter, Gauge

from pagedserve.cluster.replica import EngineReplica, PollResult, ReplicaInfo, rebuild_error
from pagedserve.cluster.routing import NoReplicaError, Router
from pagedserve.config import EngineConfig
from pagedserve.engine.async_llm import EngineDeadError, EngineNotReadyError, EngineStepError, PromptType, RequestStream
from pagedserve.engine.chat import load_chat_template
from pagedserve.engine.kv_view import EngineCapture
from pagedserve.engine.protocol import EngineStatLogger, Params, check_num_prompts
from pagedserve.engine.tokenizer import front_end_tokenizer
from pagedserve.kv.block_pool import kv_salt
from pagedserve.lora.adapter import adapter_fingerprint
from pagedserve.lora.request import LoRARequest
from pagedserve.utils import cdiv

logger = logging.getLogger(__name__)

POLL_INTERVAL = 0.02          # seconds between a replica's polls (KV events and stats)
MAX_RESTARTS = 4              # Ray restarts a dead replica actor this often
COMEBACK_TIMEOUT = 300.0      # seconds a down replica may keep failing to start before it is given up
RAY_NAMESPACE = "pagedserve"


def init_ray(address: str | None, num_cpus: int | None = None) -> bool:
    """Join the Ray cluster at `address` ("auto": the one this node belongs to), or start a
    local instance; returns whether this call connected this process (False: it already was).
    ray.shutdown() then disconnects, and stops the instance only if it started it."""
    try:
        import ray
    except ImportError:
        raise RuntimeError("data parallelism runs its replicas on Ray, which is not installed: "
                           "pip install -e '.[ray]'") from None
    if ray.is_initialized():
        return False
    if address:
        ray.init(address=address, ignore_reinit_error=True, log_to_driver=True)
    else:
        ray.init(num_cpus=num_cpus, include_dashboard=False, ignore_reinit_error=True)
    return True


@functools.lru_cache(maxsize=256)
def _fingerprint(lora_int_id: int, path: str) -> str:
    """An adapter's content fingerprint as the replicas' engines compute it (lora/adapter.py),
    once per (id, path): the server never gives an id twice. A Hub id (not read here): none, so
    its requests route without prefix hits, never to wrong blocks."""
    return adapter_fingerprint(path) if os.path.isdir(path) else ""


def _lora_key(lora: LoRARequest) -> str:
    """The adapter's prefix-cache key as the replica's engine makes it (LoRARequest.cache_key)."""
    return dataclasses.replace(lora, fingerprint=lora.fingerprint or _fingerprint(lora.lora_int_id,
                                                                                   lora.lora_path)).cache_key


def _prompt_ids(prompt: PromptType, tokenizer) -> tuple[list[int], str | tuple | None]:
    """The prompt's token ids and its KV salt (cache salt and LoRA adapter: kv_salt), which the
    router looks its blocks up by, as the replica's prefix cache keys them."""
    if isinstance(prompt, dict):
        ids = prompt.get("prompt_token_ids")
        if ids is None:
            ids = tokenizer.encode(prompt["prompt"])
        lora = prompt.get("lora_request")
        return list(ids), kv_salt(prompt.get("cache_salt"), _lora_key(lora) if lora is not None else None)
    if isinstance(prompt, str):
        return tokenizer.encode(prompt), None
    return list(prompt), None


class RoutedStream(RequestStream):
    """A RequestStream over requests running on several replicas: the outputs arrive from
    one pump task per replica call, cancelled when the stream is closed."""

    def __init__(self, client: "DataParallelLLM", request_ids: list[str]) -> None:
        super().__init__(client, request_ids)     # aborts go to the client, which routes them
        self._pumps: list[asyncio.Task] = []
        self.replica_of: dict[str, int] = {}     # request id -> the replica it was sent to

    def close(self) -> None:
        """Abort what is unfinished and stop the pumps (no AsyncLLM registry to leave)."""
        self.abort()
        self._unfinished.clear()
        for pump in self._pumps:
            pump.cancel()


class DataParallelLLM:
    """An EngineClient (engine/protocol.py) over N engine replicas behind a router."""

    def __init__(self, config: EngineConfig, num_replicas: int, metrics: EngineStatLogger,
                 routing_policy: str = "kv_aware", ray_address: str | None = None,
                 max_waiting_requests: int | None = None, log_interval: float | None = None,
                 num_cpus_per_replica: float = 1, ray_num_cpus: int | None = None) -> None:
        """`num_replicas` replicas of `config`, routed by `routing_policy`, reporting to `metrics`
        (per-engine series; the server passes its Prometheus logger). Connect the process to Ray
        first (init_ray, on the main thread, as run_server does); if it is not, start() joins
        `ray_address` (None: a local instance with `ray_num_cpus`, default all)."""
        self.num_replicas = num_replicas
        self.routing_policy = routing_policy
        self.config = config                      # what each replica runs
        self.router = Router(num_replicas, config.block_size, routing_policy, config.kv_cache_dtype)
        self.metrics = metrics
        self.ray_address = ray_address
        self.ray_num_cpus = ray_num_cpus
        # Each replica queues at most its share; the front end checks whole requests against all.
        self.max_waiting_requests = max_waiting_requests if max_waiting_requests and max_waiting_requests > 0 \
            else None
        self._replica_options = dict(num_cpus=num_cpus_per_replica, max_restarts=MAX_RESTARTS, max_task_retries=0)
        self._log_interval = log_interval
        self.name = f"dp-{os.getpid()}-{uuid.uuid4().hex[:6]}"   # prefix of the replicas' actor names
        self.state = "created"
        self.tokenizer: Any = None
        self.max_model_len = 0
        self.default_sampling: dict = {}   # the model's sampling defaults, as the replicas have them
        self.vocab_size = 0
        self.model_path = ""
        self.num_blocks = 0
        self.actors: list[Any] = []
        self.infos: list[ReplicaInfo | None] = [None] * num_replicas
        self._ray_connected = False   # this client connected the process to Ray (and disconnects it)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started: asyncio.Future | None = None
        self._dead: asyncio.Future | None = None
        self._tasks: list[asyncio.Task] = []
        self._where: dict[str, tuple[int, int]] = {}   # request id -> (replica, its incarnation) running it
        self._gone: set[int] = set()                # replicas that could not come back
        self._router_metrics()

    def _router_metrics(self) -> None:
        r, name, prefix = self.metrics.registry, self.metrics.model_name, self.metrics.prefix
        decisions = Counter(prefix + "router_requests", "Requests routed, by policy and decision.",
                            ["model_name", "policy", "decision"], registry=r)
        self._decisions = lambda d: decisions.labels(name, self.routing_policy, d)
        self._estimated = Counter(prefix + "router_estimated_prefix_hit_tokens",
                                  "Prompt tokens the router expected the chosen replica's prefix cache to hold.",
                                  ["model_name"], registry=r).labels(name)
        self._estimated_tier = Counter(prefix + "router_estimated_tier_hit_tokens",
                                       "Prompt tokens the router expected the chosen replica's KV tier (disk, "
                                       "host memory) to read back, past its prefix cache's.",
                                       ["model_name"], registry=r).labels(name)
        self._actual = Counter(prefix + "router_actual_prefix_hit_tokens",
                               "Prompt tokens the chosen replica's prefix cache served.",
                               ["model_name"], registry=r).labels(name)
        up = Gauge(prefix + "router_replica_up", "1 while the replica takes requests, 0 while it is down.",
                   ["model_name", "engine"], registry=r)
        indexed = Gauge(prefix + "router_indexed_blocks", "Blocks of the replica's prefix cache in the router's index.",
                        ["model_name", "engine"], registry=r)
        self._up = [up.labels(name, str(i)) for i in range(self.num_replicas)]
        self._indexed = [indexed.labels(name, str(i)) for i in range(self.num_replicas)]
        self._rerouted = Counter(prefix + "router_rerouted_requests",
                                 "Requests sent again because their replica failed before taking them.",
                                 ["model_name"], registry=r).labels(name)

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._started = self._loop.create_future()
        self._dead = self._loop.create_future()
        self.state = "starting"
        self._tasks.append(asyncio.create_task(self._start()))

    async def _start(self) -> None:
        import ray
        try:
            self._ray_connected = await asyncio.to_thread(init_ray, self.ray_address, self.ray_num_cpus)
            actor_cls = ray.remote(EngineReplica)
            self._place_on_gpus(ray.cluster_resources().get("GPU", 0))
            share = self.max_waiting_requests and cdiv(self.max_waiting_requests, self.num_replicas)
            # Named (in Ray's "pagedserve" namespace) so that operators and tests can find a replica.
            self.actors = [actor_cls.options(**self._replica_options, name=f"{self.name}-replica-{i}",
                                             namespace=RAY_NAMESPACE).remote(self.config, share, self._log_interval)
                           for i in range(self.num_replicas)]
            self.infos = list(await asyncio.gather(*(a.start.remote() for a in self.actors)))
            info = self.infos[0]
            self.tokenizer = await asyncio.to_thread(
                front_end_tokenizer, self.config.tokenizer or info.model_path, self.config.load_format == "dummy",
                load_chat_template(self.config.chat_template))
            self.model_path, self.max_model_len = info.model_path, info.max_model_len
            self.vocab_size, self.num_blocks = info.vocab_size, info.num_blocks
            self.default_sampling = info.default_sampling
        except BaseException as e:   # noqa: BLE001 - reported to whoever waits for the start
            logger.exception("the data-parallel replicas failed to start")
            self.state = "failed"
            self._started.set_exception(e)
            return
        self.state = "ready"
        self._started.set_result(None)
        for i in range(self.num_replicas):
            self._tasks.append(asyncio.create_task(self._monitor(i)))
        logger.info("%d replicas ready (%s routing): %s, max_model_len %d, %d KV blocks each", self.num_replicas,
                    self.routing_policy, self.model_path, self.max_model_len, self.num_blocks)

    def _place_on_gpus(self, num_gpus: float) -> None:
        """One GPU per replica (Ray sets each actor's CUDA_VISIBLE_DEVICES) when the cluster has a
        GPU for every replica and the engine is not told to run on CPU; otherwise replicas are
        placed by CPU only and each uses the devices it sees."""
        if self.config.device == "cpu" or num_gpus < 1:
            return
        if num_gpus >= self.num_replicas:
            self._replica_options["num_gpus"] = 1
        else:
            logger.warning("%d replicas but %d GPUs in the Ray cluster: replicas are placed by CPU and share "
                           "the GPUs they see", self.num_replicas, num_gpus)

    async def wait_started(self) -> None:
        await asyncio.shield(self._started)

    async def wait_dead(self) -> BaseException:
        return await asyncio.shield(self._dead)

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    async def shutdown(self, timeout: float = 30.0) -> None:
        import ray
        for task in self._tasks:
            task.cancel()
        if self.actors:
            try:
                await asyncio.wait_for(asyncio.gather(*(a.shutdown.remote() for a in self.actors),
                                                      return_exceptions=True), timeout)
            except asyncio.TimeoutError:
                logger.warning("replicas did not stop within %.0f s", timeout)
            for actor in self.actors:
                ray.kill(actor, no_restart=True)
        self.state = "stopped"
        if self._ray_connected:
            await asyncio.to_thread(ray.shutdown)

    # ---- requests ----------------------------------------------------------------------------
    def check_num_prompts(self, num_new: int) -> None:
        check_num_prompts(num_new, self.max_waiting_requests)

    async def add_requests(self, items: list[tuple[str, PromptType, Params]],
                           arrival_time: float | None = None) -> RoutedStream:
        """Add every request (each routed on its own) or none: the first refusal aborts the
        ones already added and is raised."""
        if not self.ready:
            raise EngineNotReadyError(f"the engine is {self.state}")
        self.check_num_prompts(len(items))
        ids = [rid for rid, _, _ in items]
        if len(set(ids)) != len(ids) or any(rid in self._where for rid in ids):
            raise ValueError(f"request ids already in use: {ids}")
        stream = RoutedStream(self, ids)
        try:
            for rid, prompt, params in items:
                gen, replica = await self._add_one(rid, prompt, params)
                stream.replica_of[rid] = replica
                stream._pumps.append(asyncio.create_task(self._pump(stream, rid, replica, gen)))
        except BaseException:
            stream.close()
            raise
        return stream

    async def _add_one(self, rid: str, prompt: PromptType, params: Params):
        """Route and add one request; a replica that fails before taking it is skipped."""
        from ray.exceptions import RayActorError
        ids, salt = _prompt_ids(prompt, self.tokenizer)
        tried: list[int] = []
        while True:
            try:
                route = self.router.route(ids, salt, exclude=tried)
            except NoReplicaError as e:
                raise EngineNotReadyError(str(e)) from None
            self._decisions(route.decision).inc()
            i = route.replica
            self._where[rid] = (i, route.incarnation)
            gen = self.actors[i].generate.remote(rid, prompt, params)
            try:
                kind, value = await (await gen.__anext__())
            except RayActorError:
                self._forget(rid)
                self._replica_down(i, route.incarnation)
                tried.append(i)
                self.router.rerouted(route, len(ids))
                self._rerouted.inc()
                logger.warning("replica %d failed before taking request %s: routing it again", i, rid)
                continue
            except BaseException:
                self._forget(rid)
                raise
            if kind == "error":
                self._forget(rid)
                raise rebuild_error(*value)
            # Counted once the request is taken: a rerouted one counts its last route only.
            self._estimated.inc(route.matched_blocks * self.router.block_size)
            self._estimated_tier.inc(route.tier_blocks * self.router.block_size)
            return gen, i

    async def _pump(self, stream: RoutedStream, rid: str, replica: int, gen) -> None:
        """Move one request's outputs from its replica's generator onto the stream."""
        from ray.exceptions import RayActorError
        try:
            async for ref in gen:
                kind, value = await ref
                if kind == "error":
                    stream._put(rebuild_error(*value))
                    return
                if value.finished:
                    self._actual.inc(value.num_cached_tokens)
                stream._put(value)
        except RayActorError as e:
            where = self._where.get(rid)
            self._replica_down(replica, where[1] if where else None)
            stream._put(EngineStepError(f"replica {replica} died while running this request: "
                                                     f"{type(e).__name__}"))
        except asyncio.CancelledError:
            pass
        except Exception as e:   # noqa: BLE001 - fails this request, never the server
            stream._put(EngineStepError(f"replica {replica} failed: {e!r}"))
        finally:
            self._forget(rid)

    def _forget(self, rid: str) -> None:
        where = self._where.pop(rid, None)
        if where is not None:
            self.router.finished(*where)   # ignored if that incarnation has gone down since

    def abort(self, request_ids: list[str]) -> None:
        by_replica: dict[int, list[str]] = {}
        for rid in request_ids:
            if rid in self._where:
                by_replica.setdefault(self._where[rid][0], []).append(rid)
        for i, rids in by_replica.items():
            self.actors[i].abort.remote(rids)

    def abort_all(self) -> None:
        for actor in self.actors:
            actor.abort_all.remote()

    async def kv_capture(self) -> EngineCapture:
        """The KV dashboard shows one engine's cache: not served over several replicas."""
        raise EngineNotReadyError("the KV dashboard shows one engine; this server runs "
                                  f"{self.num_replicas} data-parallel replicas")

    # ---- replica health ----------------------------------------------------------------------
    def _replica_down(self, i: int, incarnation: int | None = None) -> None:
        """Replica i is down; with `incarnation`, only if it is still that one (a dead
        incarnation's late errors must not take down the one Ray restarted)."""
        if incarnation is not None and incarnation != self.router.replicas[i].incarnation:
            return
        if self.router.replicas[i].alive:
            logger.error("replica %d is down: its requests fail, new ones go to the others", i)
            self.router.set_alive(i, False)
            self._up[i].set(0)
            self._indexed[i].set(0)

    async def _monitor(self, i: int) -> None:
        """Poll replica i; when it is gone, wait for Ray to restart it and start its engine."""
        from ray.exceptions import RayActorError
        actor, down_since = self.actors[i], None
        while True:
            try:
                result: PollResult = await actor.poll.remote()
            except RayActorError:
                self._replica_down(i)
                down_since = down_since or time.monotonic()
                try:
                    info = await actor.start.remote()   # runs once Ray has restarted the actor
                except Exception as e:   # noqa: BLE001 - still restarting, or its engine failed to start
                    if time.monotonic() - down_since > COMEBACK_TIMEOUT:
                        logger.error("replica %d has not come back in %.0f s (%r): given up", i, COMEBACK_TIMEOUT, e)
                        self._given_up(i)
                        return
                    await asyncio.sleep(0.5)
                    continue
                down_since = None
                self._rejoin(i, info)
                continue
            if result.incarnation != self.infos[i].incarnation:   # restarted between two polls
                self._replica_down(i)
                info = await actor.start.remote()
                self._rejoin(i, info)
                if result.incarnation != info.incarnation:
                    continue   # restarted again since: the next poll has the news
                # Else the poll's events are the new incarnation's first ones: applied below.
            self.router.apply_events(i, result.events)
            self._indexed[i].set(len(self.router.index.keys[i]))
            self._up[i].set(1 if self.router.replicas[i].alive else 0)
            for it in result.iterations:
                self.metrics.record_engine(i, result.stats, it)
            if result.stats is not None and not result.iterations:
                self.metrics.record_engine(i, result.stats, None)
            if result.state == "dead" and self.router.replicas[i].alive:
                logger.error("replica %d's engine died: restarting its actor", i)
                self._replica_down(i)
                import ray
                ray.kill(actor, no_restart=False)
            await asyncio.sleep(POLL_INTERVAL)

    def _rejoin(self, i: int, info: ReplicaInfo) -> None:
        self.infos[i] = info
        self.metrics.engines[i].restart()
        self.router.index.clear(i)
        self.router.replicas[i].alive = True
        logger.info("replica %d is back (a fresh engine, empty cache) and takes requests again", i)

    def _given_up(self, i: int) -> None:
        self._replica_down(i)
        self._gone.add(i)
        if len(self._gone) == self.num_replicas and not self._dead.done():
            self.state = "dead"
            self._dead.set_result(EngineDeadError("every data-parallel replica is gone"))
