"""Which replica a request goes to: the routing policies, the router's view of each
replica (load, liveness, cached blocks) and its counters. Pure Python, no Ray.

The router hashes a prompt with the engine's own lookup keys (kv/block_pool.py
`lookup_block_keys`, SHA-256 chained, the cache salt in the first key) and keeps, per
replica, the exact set of keys in its prefix cache from the replica's KV events
(kv/events.py). So "this replica holds the first k blocks of the prompt" is what the
replica's own lookup would find, not an estimate. With a tier below the prefix cache
(`kv_offload_path` / `kv_offload_cpu_gb`, kv/tier.py) the events also say which keys each
replica's tier holds: the blocks after the pool's hits that its tier would read back count as
hits too, at `tier_credit` of a pool hit (a read instead of a recompute, but not free).

Policies (`--routing-policy`):
- round_robin: the next live replica in turn.
- least_loaded: the fewest requests in flight (sent and not finished: running + waiting).
- prefix_hash: consistent hashing of the prompt's first blocks (a ring with virtual nodes,
  so a replica leaving moves only its own share); no full block: least_loaded.
- kv_aware (default): the most cached prefix blocks (tier blocks at `tier_credit` each), less a
  penalty per request in flight; plain
  least_loaded when the replicas are imbalanced beyond both thresholds (as SGLang's router
  does) or when no replica matches enough of the prompt (as Ray Serve's prefix-aware router
  does).
"""
from __future__ import annotations

import bisect
import hashlib
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from pagedserve.config import ROUTING_POLICIES
from pagedserve.kv.block_pool import BlockKey, lookup_block_keys
from pagedserve.kv.events import KVEvent


class NoReplicaError(RuntimeError):
    """No replica is alive to take the request."""


class KVIndex:
    """Per replica, the exact set of block keys in its prefix cache, and in the tier below it,
    kept from its KV events."""

    def __init__(self, num_replicas: int) -> None:
        self.keys: list[set[BlockKey]] = [set() for _ in range(num_replicas)]
        self.tier: list[set[BlockKey]] = [set() for _ in range(num_replicas)]

    def apply(self, replica: int, events: Iterable[KVEvent]) -> None:
        keys, tier = self.keys[replica], self.tier[replica]
        for kind, key in events:
            if kind == "stored":
                keys.add(key)
            elif kind == "removed":
                keys.discard(key)
            elif kind == "tier_stored":
                tier.add(key)
            elif kind == "tier_removed":
                tier.discard(key)
            else:   # "cleared": the replica's pool started afresh (its tier outlives that)
                keys.clear()

    def clear(self, replica: int) -> None:
        """The replica is gone: its pool and its index of the tier (a new engine reports its tier)."""
        self.keys[replica].clear()
        self.tier[replica].clear()

    def matched_tier_blocks(self, replica: int, prompt_keys: Sequence[BlockKey], start: int) -> int:
        """How many of the prompt's blocks from `start` (past the pool's hits) the replica's tier
        holds in a run: those its scheduler would read back instead of computing."""
        tier = self.tier[replica]
        n = 0
        for key in prompt_keys[start:]:
            if key not in tier:
                break
            n += 1
        return n

    def matched_blocks(self, replica: int, prompt_keys: Sequence[BlockKey]) -> int:
        """How many of the prompt's first blocks the replica's lookup would find (it stops at
        the first miss, and so does this)."""
        keys = self.keys[replica]
        n = 0
        for key in prompt_keys:
            if key not in keys:
                break
            n += 1
        return n

    def sink(self, replica: int) -> "_IndexSink":
        """A KVEventSink feeding this index directly (one process: the simulator, tests)."""
        return _IndexSink(self, replica)


class _IndexSink:
    def __init__(self, index: KVIndex, replica: int) -> None:
        self._keys = index.keys[replica]
        self._tier = index.tier[replica]

    def stored(self, key: BlockKey) -> None:
        self._keys.add(key)

    def removed(self, key: BlockKey) -> None:
        self._keys.discard(key)

    def cleared(self) -> None:
        self._keys.clear()

    def tier_stored(self, key: BlockKey) -> None:
        self._tier.add(key)

    def tier_removed(self, key: BlockKey) -> None:
        self._tier.discard(key)


@dataclass
class ReplicaView:
    """What the router knows of one replica."""
    alive: bool = True
    in_flight: int = 0        # requests routed here and not finished (its running + waiting)
    incarnation: int = 0      # +1 each time it goes down: a dead incarnation's late news is ignored


@dataclass
class RouteRequest:
    keys: list[BlockKey]      # lookup_block_keys of the prompt


@dataclass
class Route:
    replica: int
    decision: str             # why: round_robin | least_loaded | prefix_hash | prefix | tier | load | imbalanced
    matched_blocks: int       # blocks of the prompt the router expects the replica to hold
    incarnation: int = 0      # the replica's incarnation when routed (Router sets it)
    tier_blocks: int = 0      # the next blocks, expected in the replica's tier (read back, not computed)


class RoutingPolicy:
    name = ""

    def choose(self, req: RouteRequest, replicas: list[ReplicaView], live: list[int], index: KVIndex) -> Route:
        raise NotImplementedError


class _Rotation:
    """Ties broken in turn, so equal replicas share the work."""

    def __init__(self) -> None:
        self.turn = 0

    def pick(self, candidates: list[int]) -> int:
        self.turn += 1
        return candidates[self.turn % len(candidates)]


def least_loaded(replicas: list[ReplicaView], live: list[int], rotation: _Rotation) -> int:
    low = min(replicas[i].in_flight for i in live)
    return rotation.pick([i for i in live if replicas[i].in_flight == low])


class RoundRobin(RoutingPolicy):
    name = "round_robin"

    def __init__(self) -> None:
        self.rotation = _Rotation()

    def choose(self, req, replicas, live, index):
        i = self.rotation.pick(live)
        return Route(i, "round_robin", index.matched_blocks(i, req.keys))


class LeastLoaded(RoutingPolicy):
    name = "least_loaded"

    def __init__(self) -> None:
        self.rotation = _Rotation()

    def choose(self, req, replicas, live, index):
        i = least_loaded(replicas, live, self.rotation)
        return Route(i, "least_loaded", index.matched_blocks(i, req.keys))


class PrefixHash(RoutingPolicy):
    """Consistent hashing on the key of the prompt's `num_blocks`-th block (or its last full
    one): the chained key stands for the whole prefix up to it."""
    name = "prefix_hash"

    def __init__(self, num_replicas: int, num_blocks: int = 4, virtual_nodes: int = 64) -> None:
        self.num_blocks = num_blocks
        points = []
        for r in range(num_replicas):
            for v in range(virtual_nodes):
                points.append((int.from_bytes(hashlib.sha256(f"{r}/{v}".encode()).digest()[:8], "big"), r))
        points.sort()
        self.ring = [p for p, _ in points]
        self.owner = [r for _, r in points]
        self.rotation = _Rotation()

    def choose(self, req, replicas, live, index):
        if not req.keys:
            i = least_loaded(replicas, live, self.rotation)
            return Route(i, "least_loaded", 0)
        point = int.from_bytes(req.keys[min(self.num_blocks, len(req.keys)) - 1][:8], "big")
        start = bisect.bisect(self.ring, point)
        for step in range(len(self.ring)):   # clockwise to the first live owner
            i = self.owner[(start + step) % len(self.ring)]
            if replicas[i].alive:
                return Route(i, "prefix_hash", index.matched_blocks(i, req.keys))
        raise NoReplicaError("no replica is alive")


class KVAware(RoutingPolicy):
    """score = matched blocks + tier_credit * tier blocks - load_penalty * requests in flight: a
    request ahead in the queue costs about as much as recomputing `load_penalty` blocks of
    prompt, and a block read back from the tier saves most of a recompute (a read costs a few ms
    of disk or memory bandwidth where a block's prefill costs tens to hundreds of ms on a CPU)."""
    name = "kv_aware"

    def __init__(self, load_penalty: float = 4.0, balance_abs_threshold: int = 16,
                 balance_rel_threshold: float = 1.5, min_match: float = 0.1, tier_credit: float = 0.75) -> None:
        self.load_penalty = load_penalty
        self.tier_credit = tier_credit
        self.balance_abs_threshold = balance_abs_threshold   # in-flight requests, max - min
        self.balance_rel_threshold = balance_rel_threshold   # max > this * min
        self.min_match = min_match                           # share of the prompt's blocks
        self.rotation = _Rotation()

    def imbalanced(self, loads: list[int]) -> bool:
        high, low = max(loads), min(loads)
        return high - low > self.balance_abs_threshold and high > self.balance_rel_threshold * low

    def choose(self, req, replicas, live, index):
        loads = [replicas[i].in_flight for i in live]
        if self.imbalanced(loads):
            i = least_loaded(replicas, live, self.rotation)
            return Route(i, "imbalanced", index.matched_blocks(i, req.keys))
        matched = {i: index.matched_blocks(i, req.keys) for i in live}
        tier = {i: index.matched_tier_blocks(i, req.keys, matched[i]) for i in live}
        credit = {i: matched[i] + self.tier_credit * tier[i] for i in live}
        if not req.keys or max(credit.values()) < self.min_match * len(req.keys):
            i = least_loaded(replicas, live, self.rotation)
            return Route(i, "load", matched[i], tier_blocks=tier[i])
        scores = {i: credit[i] - self.load_penalty * replicas[i].in_flight for i in live}
        top = max(scores.values())
        i = self.rotation.pick([i for i in live if scores[i] == top])
        decision = "prefix" if matched[i] else "tier" if tier[i] else "load"
        return Route(i, decision, matched[i], tier_blocks=tier[i])


def make_policy(name: str, num_replicas: int) -> RoutingPolicy:
    if name == "round_robin":
        return RoundRobin()
    if name == "least_loaded":
        return LeastLoaded()
    if name == "prefix_hash":
        return PrefixHash(num_replicas)
    if name == "kv_aware":
        return KVAware()
    raise ValueError(f"routing_policy must be one of {', '.join(ROUTING_POLICIES)}; got {name!r}")


@dataclass
class RouterCounters:
    decisions: Counter = field(default_factory=Counter)   # decision -> requests
    prompt_tokens: int = 0
    estimated_hit_tokens: int = 0   # tokens of routed prompts the router expected in the chosen cache
    estimated_tier_hit_tokens: int = 0   # ... and in the chosen replica's tier (past the cache's hits)
    rerouted: int = 0               # requests sent again after their replica failed before starting them


class Router:
    """The policy plus the router's view of every replica. Call `route` for each request,
    `finished` when it ends, `apply_events` with each replica's KV events."""

    def __init__(self, num_replicas: int, block_size: int, policy: str | RoutingPolicy = "kv_aware",
                 kv_cache_dtype: str = "auto") -> None:
        self.block_size = block_size
        self.kv_cache_dtype = kv_cache_dtype      # the replicas' keys include it (block_pool.first_block_extra_keys)
        self.replicas = [ReplicaView() for _ in range(num_replicas)]
        self.index = KVIndex(num_replicas)
        self.policy = make_policy(policy, num_replicas) if isinstance(policy, str) else policy
        self.counters = RouterCounters()

    @property
    def live(self) -> list[int]:
        return [i for i, r in enumerate(self.replicas) if r.alive]

    def route(self, token_ids: Sequence[int], cache_salt: str | None = None, exclude: Iterable[int] = ()) -> Route:
        """Choose a live replica (not in `exclude`) and count the request as in flight there."""
        excluded = set(exclude)
        live = [i for i in self.live if i not in excluded]
        if not live:
            raise NoReplicaError("no replica is alive to take the request")
        req = RouteRequest(lookup_block_keys(token_ids, self.block_size, cache_salt, self.kv_cache_dtype))
        view = self.replicas
        if excluded:   # the policy sees only the candidates
            view = [ReplicaView(alive=r.alive and i not in excluded, in_flight=r.in_flight)
                    for i, r in enumerate(self.replicas)]
        route = self.policy.choose(req, view, live, self.index)
        target = self.replicas[route.replica]
        target.in_flight += 1
        route.incarnation = target.incarnation
        c = self.counters
        c.decisions[route.decision] += 1
        c.prompt_tokens += len(token_ids)
        c.estimated_hit_tokens += route.matched_blocks * self.block_size
        c.estimated_tier_hit_tokens += route.tier_blocks * self.block_size
        return route

    def rerouted(self, route: Route, num_prompt_tokens: int) -> None:
        """The route's replica failed before taking the request, which is routed again: its
        prompt and expected hits are counted by the next route, not twice."""
        c = self.counters
        c.rerouted += 1
        c.prompt_tokens -= num_prompt_tokens
        c.estimated_hit_tokens -= route.matched_blocks * self.block_size
        c.estimated_tier_hit_tokens -= route.tier_blocks * self.block_size

    def finished(self, replica: int, incarnation: int | None = None) -> None:
        """A request routed to `replica` (in `incarnation`, if given) has ended. One of an
        incarnation that has since gone down was already uncounted when it went."""
        view = self.replicas[replica]
        if incarnation is not None and incarnation != view.incarnation:
            return
        view.in_flight = max(0, view.in_flight - 1)

    def apply_events(self, replica: int, events: Iterable[KVEvent]) -> None:
        self.index.apply(replica, events)

    def set_alive(self, replica: int, alive: bool) -> None:
        """A replica that went away lost its cache and its requests; it comes back empty."""
        view = self.replicas[replica]
        if not alive and view.alive:
            view.incarnation += 1
        view.alive = alive
        if not alive:
            view.in_flight = 0
            self.index.clear(replica)
