"""benchmarks/cluster.py: its multi-turn trace, and its simulated part on a few hundred requests."""
import argparse

from benchmarks.cluster import multi_tenant_trace, run_sim, tables


def test_trace_turns_extend_the_conversation():
    trace = multi_tenant_trace(30, num_systems=2, turns=3, user_rate=1.0, seed=1)
    by_user: dict = {}
    for r in trace:
        by_user.setdefault(r.request_id.split("-")[0], []).append(r)
    for turns in by_user.values():
        for a, b in zip(turns, turns[1:]):
            assert b.arrival >= a.arrival and b.prompt[:len(a.prompt) + len(a.output)] == a.prompt + a.output


def test_sim_part_smoke():
    args = argparse.Namespace(sim_max_num_seqs=16, sim_replicas=[2, 4], sim_requests=200, systems=3, turns=2,
                              sim_rate=20.0, seed=0, output_len=6, think_time=1.0, sim_blocks=64,
                              policies=["kv_aware", "round_robin", "least_loaded", "prefix_hash"])
    rows = run_sim(args)
    assert len(rows) == 8 and all(r["requests"] == 200 for r in rows)
    assert "| 4 | kv_aware |" in tables([], rows)
    for r in rows:
        assert 0 < r["hit_rate"] < 1 and r["queue_p99"] >= r["queue_mean"] >= 0
