"""Routing policies on a fake replica table, and the router's KV index against the real
caches of real schedulers (no model, no Ray)."""
import random

import pytest

from pagedserve.cluster.routing import KVIndex, NoReplicaError, Router
from pagedserve.cluster.sim import ClusterSim, SimReplica, SimRequest, CostStepTime
from pagedserve.config import EngineConfig
from pagedserve.kv.block_pool import lookup_block_keys
from pagedserve.kv.events import KVEventLog

B = 4


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 1000) for _ in range(n)]


def index_holding(num_replicas: int, holdings: dict[int, list[int]]) -> KVIndex:
    index = KVIndex(num_replicas)
    for replica, prompt in holdings.items():
        index.apply(replica, [("stored", k) for k in lookup_block_keys(prompt, B)])
    return index


def test_round_robin_takes_live_replicas_in_turn():
    router = Router(3, B, "round_robin")
    assert [router.route([1] * 9).replica for _ in range(6)] in ([1, 2, 0, 1, 2, 0], [0, 1, 2, 0, 1, 2])
    router.set_alive(1, False)
    assert {router.route([1] * 9).replica for _ in range(6)} == {0, 2}


def test_least_loaded_counts_requests_in_flight():
    router = Router(3, B, "least_loaded")
    picks = [router.route([1] * 9).replica for _ in range(3)]
    assert sorted(picks) == [0, 1, 2]                      # equal loads share
    router.finished(picks[1])
    assert router.route([1] * 9).replica == picks[1]      # the one with room
    assert [r.in_flight for r in router.replicas] == [1, 1, 1]


def test_prefix_hash_is_sticky_and_moves_only_a_dead_replicas_share():
    router = Router(4, B, "prefix_hash")
    prompts = [tokens(i, 40) for i in range(200)]
    first = [router.route(p).replica for p in prompts]
    assert first == [router.route(p).replica for p in prompts]          # same prefix, same replica
    assert len(set(first)) == 4                                         # and the ring spreads them
    # A longer prompt with the same first 4 blocks hashes the same.
    assert router.route(prompts[0][:16] + [5] * 30).replica == first[0]
    router.set_alive(2, False)
    after = [router.route(p).replica for p in prompts]
    assert all(a == f for a, f in zip(after, first) if f != 2)          # only replica 2's prompts move
    assert 2 not in after


def test_kv_aware_goes_where_the_prefix_is_unless_imbalanced():
    system = tokens(1, 64)
    router = Router(3, B, "kv_aware")
    router.index = index_holding(3, {2: system + [9] * 8})
    route = router.route(system + tokens(2, 10))
    assert (route.replica, route.decision, route.matched_blocks) == (2, "prefix", 16)
    # A salted request shares nothing with the unsalted cache.
    assert router.route(system + tokens(2, 10), cache_salt="tenant-a").decision == "load"
    # Unmatched prompts go by load.
    router.replicas[0].in_flight, router.replicas[1].in_flight = 5, 0
    assert router.route(tokens(3, 30)).replica == 1
    # Beyond the thresholds the holder is skipped for the least loaded.
    router.replicas[2].in_flight, router.replicas[0].in_flight, router.replicas[1].in_flight = 40, 3, 3
    route = router.route(system + tokens(4, 10))
    assert route.decision == "imbalanced" and route.replica in (0, 1)
    assert router.counters.decisions == {"prefix": 1, "load": 2, "imbalanced": 1}
    assert router.counters.estimated_hit_tokens == 16 * B


def test_kv_aware_load_penalty_breaks_a_near_tie():
    system = tokens(5, 64)
    router = Router(2, B, "kv_aware")
    router.index = index_holding(2, {0: system[:32] + [3], 1: system + [3]})   # 8 vs 16 blocks
    router.replicas[1].in_flight = 3          # 16 - 4 * 3 = 4 < 8: the shorter match, idle, wins
    assert router.route(system + [7] * 5).replica == 0
    router.replicas[0].in_flight = 0
    router.replicas[1].in_flight = 1          # 16 - 4 = 12 > 8
    assert router.route(system + [7] * 5).replica == 1


def test_no_live_replica_is_an_error():
    router = Router(2, B, "kv_aware")
    router.set_alive(0, False)
    assert router.route([1] * 9, exclude=[]).replica == 1
    with pytest.raises(NoReplicaError):
        router.route([1] * 9, exclude=[1])


def shared_prefix_trace(num_requests: int, seed: int, num_systems: int = 5) -> list[SimRequest]:
    rng = random.Random(seed)
    systems = [tokens(100 + i, rng.randrange(8, 40)) for i in range(num_systems)]
    trace, t = [], 0.0
    for i in range(num_requests):
        t += rng.expovariate(200.0)
        prompt = rng.choice(systems) + tokens(seed * 10_000 + i, rng.randrange(1, 30))
        salt = "s" if rng.random() < 0.1 else None
        trace.append(SimRequest(f"r{i}", t, prompt, tokens(-i, rng.randrange(1, 12)), salt))
    return trace


@pytest.mark.parametrize("policy", ["kv_aware", "round_robin"])
def test_the_index_is_exactly_each_replicas_cache_through_evictions(policy):
    """Replicas with small caches (so blocks are evicted all the time) serve a shared-prefix
    workload; after every step the router's index, fed by each pool's events through the
    event log a Ray replica drains, equals the keys in that replica's prefix cache, and
    the router's estimate of a request's prefix hit is what the replica's lookup found."""
    config = EngineConfig(block_size=B, max_num_seqs=4, max_num_batched_tokens=64)
    router = Router(3, B, policy)
    logs = [KVEventLog() for _ in range(3)]
    replicas = [SimReplica(config, 24, 256, CostStepTime(), logs[i]) for i in range(3)]
    evictions = exact = 0
    for req in shared_prefix_trace(150, seed=7):
        for i, r in enumerate(replicas):                # requests admitted right after routing
            router.apply_events(i, logs[i].drain())
        route = router.route(req.prompt, req.cache_salt)
        added = replicas[route.replica].add(req)
        for i, replica in enumerate(replicas):
            while replica.busy:
                _, out, finished = replica.step(0.0)
                for r in finished:
                    router.finished(i)
                router.apply_events(i, logs[i].drain())
                assert router.index.keys[i] == set(replica.sched.kv.pool.cached), f"replica {i} after a step"
            if i == route.replica:
                exact += added.num_cached_tokens == route.matched_blocks * B
        evictions = sum(r.sched.kv.pool.num_evictions for r in replicas)
    assert exact == 150
    assert evictions > 50, "the workload must evict"
    assert router.counters.estimated_hit_tokens > 0


def test_a_reset_replica_is_empty_in_the_index():
    log, index = KVEventLog(), KVIndex(1)
    config = EngineConfig(block_size=B)
    replica = SimReplica(config, 32, 256, CostStepTime(), log)
    replica.add(SimRequest("a", 0.0, tokens(1, 20), [1, 2]))
    while replica.busy:
        replica.step(0.0)
    index.apply(0, log.drain())
    assert index.keys[0] and index.keys[0] == set(replica.sched.kv.pool.cached)
    replica = SimReplica(config, 32, 256, CostStepTime(), log)   # what LLMEngine.reset does: a new pool
    index.apply(0, log.drain())
    assert index.keys[0] == set()


def test_cluster_sim_kv_aware_hits_more_than_round_robin():
    config = EngineConfig(block_size=B, max_num_seqs=8, max_num_batched_tokens=128)
    trace = shared_prefix_trace(300, seed=3, num_systems=8)
    hit = {}
    for policy in ("kv_aware", "round_robin"):
        sim = ClusterSim.build(4, policy, config, num_blocks=48, max_model_len=256)
        results = sim.run(trace)
        assert len(results) == 300
        assert all(r.arrival <= r.first_scheduled <= r.first_token <= r.finished for r in results)
        assert all(sim.router.index.keys[i] == set(rep.sched.kv.pool.cached) for i, rep in enumerate(sim.replicas))
        hit[policy] = sum(r.num_cached_tokens for r in results) / sum(r.num_prompt_tokens for r in results)
    assert hit["kv_aware"] > hit["round_robin"]


def test_kv_aware_counts_a_tier_hit_as_a_cheaper_hit():
    """Replica 0 holds 8 blocks of the prompt in its pool; replica 1 the first 4 in its pool and
    the next 12 in its tier (disk or host memory): 4 + 0.75 * 12 = 13 > 8, so replica 1, and
    a tier run counts only where it continues the pool's hits (the replica's fetch stops there)."""
    system = tokens(11, 64)
    keys = lookup_block_keys(system + [5], B)
    router = Router(2, B, "kv_aware")
    router.apply_events(0, [("stored", k) for k in keys[:8]])
    router.apply_events(1, [("stored", k) for k in keys[:4]] + [("tier_stored", k) for k in keys[4:16]])
    route = router.route(system + tokens(12, 10))
    assert (route.replica, route.decision, route.matched_blocks, route.tier_blocks) == (1, "prefix", 4, 12)
    assert router.counters.estimated_tier_hit_tokens == 12 * B
    # A tier alone is a hit too ("tier"), and its blocks leave with tier_removed.
    router.apply_events(1, [("removed", k) for k in keys[:4]] + [("tier_stored", k) for k in keys[:4]])
    router.finished(1)
    route = router.route(system + tokens(13, 10))
    assert (route.replica, route.decision, route.tier_blocks) == (1, "tier", 16)
    router.finished(1)
    router.apply_events(1, [("tier_removed", k) for k in keys[2:16]] + [("cleared", None)])
    assert router.index.tier[1] == set(keys[:2])          # a pool reset keeps the tier's keys
    route = router.route(system + tokens(14, 10))         # 8 pool blocks beat 0.75 * 2
    assert (route.replica, route.matched_blocks) == (0, 8)
    router.set_alive(1, False)                             # a replica gone: its tier is forgotten
    assert router.index.tier[1] == set()


def test_the_tier_index_reports_every_key_it_gains_and_loses():
    """The engine's TierIndex (kv/tier.py) through a KVEventLog, as a Ray replica's poll carries
    it: after saves past its capacity, failed and lost reads, and a restart from the directory's
    keys, the router's view of the tier is the index's keys."""
    from pagedserve.kv.block_pool import BlockPool, block_key
    from pagedserve.kv.tier import TierIndex, TierLink
    log, index = KVEventLog(), KVIndex(1)
    keys = [block_key(None, [i]) for i in range(10)]
    tier = TierIndex(capacity=6, keys=keys[:3], events=log)          # a restart: the files found
    pool = BlockPool(4, events=log)
    link = TierLink(pool, tier)
    for start in (3, 7):                                              # cached, then evicted: saved
        blocks = pool.allocate(min(4, 10 - start))
        for b, k in zip(blocks, keys[start:]):
            pool.cache(b, k)
        pool.release(blocks)
    pool.release(pool.allocate(4))
    link.finished([], [])
    link.forget([keys[9]])                                            # a file gone (the size bound)
    index.apply(0, log.drain())
    assert index.tier[0] == set(tier.keys) and len(tier.keys) == 5
    assert index.keys[0] == set(pool.cached)
