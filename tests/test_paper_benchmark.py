"""benchmarks/: the synthetic workloads, the model-free memory simulation, and a smoke run of
benchmarks/paper.py on a tiny model (the real numbers come from running it by hand)."""
import json
import math

import pytest

from benchmarks import paper
from benchmarks.memory_sim import simulate_saturation
from benchmarks.workloads import make_trace, poisson_arrivals, trace_lengths


@pytest.mark.parametrize("workload,mean_in,mean_out", [("sharegpt", 161, 338), ("alpaca", 19, 58)])
def test_lengths_follow_the_papers_means_and_fit_the_context(workload, mean_in, mean_out):
    lengths = trace_lengths(workload, 4000, seed=1, max_model_len=4096)
    ins, outs = [p for p, _ in lengths], [o for _, o in lengths]
    assert abs(sum(ins) / len(ins) / mean_in - 1) < 0.1
    assert abs(sum(outs) / len(outs) / mean_out - 1) < 0.1
    assert min(ins) >= 4 and min(outs) >= 4 and max(outs) > 3 * mean_out        # long-tailed
    short = trace_lengths(workload, 500, seed=1, max_model_len=64, scale=1 / 8)
    assert min(p for p, _ in short) >= 1 and max(p + o for p, o in short) <= 64


def test_traces_are_seeded_and_share_requests_across_rates():
    a = make_trace("sharegpt", 20, 3, 1000, 256, 2.0, scale=1 / 8)
    b = make_trace("sharegpt", 20, 3, 1000, 256, 8.0, scale=1 / 8)
    assert [(r.prompt_token_ids, r.output_len) for r in a] == [(r.prompt_token_ids, r.output_len) for r in b]
    assert [r.arrival_time for r in a] == pytest.approx([4 * r.arrival_time for r in b])   # same draws, rescaled
    assert a[-1].arrival_time > 0 and all(100 <= t < 1000 for r in a for t in r.prompt_token_ids)
    assert make_trace("sharegpt", 20, 4, 1000, 256)[0].prompt_token_ids != a[0].prompt_token_ids
    assert poisson_arrivals(3, math.inf) == [0.0] * 3
    times = poisson_arrivals(4000, 10.0, seed=0)
    assert abs(times[-1] / 4000 - 0.1) < 0.01                     # mean gap 1 / rate


def test_memory_simulation_orders_the_allocators_like_the_paper():
    lengths = trace_lengths("sharegpt", 60, seed=0, max_model_len=256, scale=1 / 8)
    res = {a: simulate_saturation(a, lengths, block_size=2, kv_slots=1920, max_model_len=256)
           for a in ("paged", "oracle", "pow2", "max")}
    batch = {a: r.saturated_batch_size for a, r in res.items()}
    tokens = {a: r.shares()["token_states"] for a, r in res.items()}
    assert batch["max"] == 7 and batch["paged"] > batch["oracle"] > batch["pow2"] > batch["max"]
    assert tokens["paged"] > 0.9 > tokens["oracle"] > tokens["pow2"] > tokens["max"]
    assert res["max"].shares()["internal_fragmentation"] > 0.4
    assert all(r.num_preemptions == 0 for a, r in res.items() if a != "paged")


def test_paper_benchmark_smoke(tiny_llama, tmp_path):
    paper.main(["--quick", "--model", tiny_llama.path, "--dtype", "float32", "--out", str(tmp_path),
                "--memory-requests", "40", "--num-requests", "8"])
    data = json.loads((tmp_path / "paper.json").read_text())
    res = data["results"]
    assert set(res["memory"]) == {"sharegpt", "alpaca"} and set(res["engine"]) == {"sharegpt"}
    eng = res["engine"]["sharegpt"]
    assert set(eng["burst"]) == set(eng["sweep"]) == {"paged", "oracle", "pow2", "max"}
    assert all("steady_throughput_rps" in r and "num_recomputed_tokens" in r for r in eng["burst"].values())
    capacity = max(r["steady_throughput_rps"] for r in eng["burst"].values())
    assert max(p["rate"] for p in eng["sweep"]["paged"]) >= 2 * capacity * 0.999      # past every allocator's
    assert len(eng["block_size_ablation"]["runs"]) == 2
    assert all(p["num_requests"] == 8 for pts in eng["sweep"].values() for p in pts)
    for name in ("fig2_memory_waste", "fig12_latency_vs_rate", "fig13_batch_size", "fig18b_block_size"):
        assert (tmp_path / f"{name}.png").stat().st_size > 1000


def test_paper_simulation_smoke(tmp_path, monkeypatch):
    """paper.py --simulate writes paper_sim.json with the issue's interface (a tiny setup)."""
    from benchmarks import paper_sim
    monkeypatch.setattr(paper_sim, "quick_sim_setup", lambda: paper_sim.SimSetup(
        num_requests={"sharegpt": 12, "alpaca": 12}, num_rates=3, fig14_requests=6, chatbot_requests=8,
        fig14_widths=[2]))
    assert paper.main(["--simulate", "a100-40gb", "--model-preset", "opt-13b", "--quick", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "paper_sim.json").read_text())
    for w in ("sharegpt", "alpaca", "chatbot"):
        assert set(data[w]["sustained_rate"]) == {"paged", "oracle", "pow2", "max"}
        capacity = max(s["steady_throughput_rps"] for s in data[w]["saturation"].values())
        assert max(data[w]["rates"]) >= 2 * capacity * 0.999
    assert "relative_error" in data["validation"]
    assert data["kv_slots"] > 15000 and data["fig14"]["beam"][0]["sharing_saving_avg"] > 0
    for name in ("sim_fig12_opt-13b_a100-40gb", "sim_fig14_opt-13b_a100-40gb"):
        assert (tmp_path / f"{name}.png").stat().st_size > 1000
