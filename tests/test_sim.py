"""The step-time simulator: model shapes from configs, the cost model's arithmetic, and the
driver running the real scheduler and KV managers to the end on the simulated clock."""
import math

import pytest

from pagedserve.models.presets import PRESETS
from pagedserve.sim import (DEVICES, CostModel, Device, Efficiency, ModelShape, SimConfig, SimRequest, StepWork,
                            simulate, sustained_rate)


def test_preset_shapes_match_the_published_sizes():
    # Parameter counts in the names, and the paper's Table 1 KV slots (15.7k, 9.7k, 60.1k).
    for name, billions in (("opt-13b", 13), ("opt-66b", 66), ("opt-175b", 175), ("llama-13b", 13)):
        params = ModelShape.preset(name).weight_bytes / 2 / 1e9
        assert abs(params / billions - 1) < 0.03, (name, params)
    assert ModelShape.preset("opt-13b").kv_bytes_per_token == 2 * 40 * 5120 * 2
    slots = {name: CostModel(ModelShape.preset(name), DEVICES[dev], tp).kv_cache_tokens()
             for name, dev, tp in (("opt-13b", "a100-40gb", 1), ("opt-66b", "a100-40gb", 4),
                                   ("opt-175b", "a100-80gb", 8))}
    assert abs(slots["opt-13b"] / 15.7e3 - 1) < 0.05
    assert abs(slots["opt-66b"] / 9.7e3 - 1) < 0.05
    assert abs(slots["opt-175b"] / 60.1e3 - 1) < 0.1
    assert ModelShape.from_config(PRESETS["llama-13b"]).gated_mlp and not ModelShape.preset("opt-13b").gated_mlp


def test_step_work_counts_tokens_pairs_and_kv_reads():
    w = StepWork.of([(10, 1), (0, 4), (6, 2)], num_sampled=2)
    assert (w.num_tokens, w.num_seqs, w.num_sampled) == (7, 3, 2)
    assert w.decode_pairs == 11                          # one query over 11 keys
    assert w.prefill_pairs == (1 + 2 + 3 + 4) + (7 + 8)  # causal: query i sees start + i + 1 keys
    assert w.prefill_kv_tokens == 4 + 8


def test_cost_model_is_a_roofline_per_operation_class():
    shape = ModelShape.preset("opt-13b")
    dev = Device("toy", matmul_flops=100e12, memory_bandwidth=1e12, memory_bytes=80 * 2**30, link_bandwidth=100e9,
                 efficiency=Efficiency(), source="test")
    cost = CostModel(shape, dev)
    one = cost.step_time(StepWork.of([(100, 1)], 1))
    # Decoding one token is memory-bound: the weights once (and 101 tokens of KV).
    assert one.linear == pytest.approx(shape.num_layers * shape.layer_params * 2 / 1e12)
    assert one.decode_attention == pytest.approx(101 * shape.kv_bytes_per_token / 1e12)
    big = cost.step_time(StepWork.of([(0, 2000)], 1))
    # A 2000-token prefill is compute-bound.
    assert big.linear == pytest.approx(2 * shape.num_layers * shape.layer_params * 2000 / 100e12)
    assert big.allreduce == 0 and one.total < big.total
    tp = CostModel(shape, dev, tp=4).step_time(StepWork.of([(0, 2000)], 1))
    assert tp.linear == pytest.approx(big.linear / 4) and tp.allreduce > 0


def _trace(num, rate, **kw):
    gap = 0 if math.isinf(rate) else 1 / rate
    return [SimRequest([5 + i % 7] * (20 + 13 * (i % 5)), 10 + 7 * (i % 4), i * gap, **kw) for i in range(num)]


@pytest.mark.parametrize("allocator", ["paged", "oracle", "pow2", "max"])
def test_the_driver_runs_the_real_scheduler_to_the_end(allocator):
    cost = CostModel(ModelShape.preset("opt-13b"), DEVICES["a100-40gb"])
    r = simulate(_trace(40, math.inf), SimConfig(kv_allocator=allocator, num_blocks=40, block_size=4,
                                                 max_model_len=128, admission_watermark=0.0), cost)
    assert r.num_requests == 40 and r.num_steps > 0 and r.busy_time_s == pytest.approx(r.duration_s)
    assert r.mean_normalized_latency > 0 and r.steady_throughput_rps > 0
    if allocator != "paged":
        assert r.num_preemptions == 0


def test_paging_batches_more_than_reservation_and_latency_grows_with_rate():
    cost = CostModel(ModelShape.preset("opt-13b"), DEVICES["a100-40gb"])
    config = lambda a: SimConfig(kv_allocator=a, num_blocks=40, block_size=4, max_model_len=128)  # noqa: E731
    paged, oracle, mx = (simulate(_trace(60, math.inf), config(a), cost) for a in ("paged", "oracle", "max"))
    assert paged.avg_batch_size > oracle.avg_batch_size > mx.avg_batch_size
    assert paged.steady_throughput_rps > mx.steady_throughput_rps
    slow, fast = (simulate(_trace(60, rate), config("paged"), cost) for rate in (1.0, 1000.0))
    assert slow.mean_normalized_latency < fast.mean_normalized_latency


def test_parallel_sampling_and_beam_search_share_blocks():
    cost = CostModel(ModelShape.preset("opt-13b"), DEVICES["a100-40gb"])
    config = SimConfig(num_blocks=200, block_size=4, max_model_len=128)
    for kw in ({"n": 3}, {"beam_width": 3}):
        r = simulate(_trace(10, math.inf, **kw), config, cost)
        assert r.sharing_saving_avg > 0, kw


def test_sustained_rate_interpolates_at_the_bound():
    assert sustained_rate([(1, 0.1), (2, 0.2), (3, 1.0)], 0.6)["rate"] == pytest.approx(2.5)
    assert sustained_rate([(1, 0.1), (2, 0.2)], 0.6)["note"].startswith("at least")
    assert sustained_rate([(1, 0.9)], 0.6)["rate"] is None


def test_a_request_that_asks_for_more_stops_at_its_traced_length():
    """A chatbot-style request: max_tokens 64, answer 10 tokens. The baselines reserve what it
    asks for, the paged cache only what it uses."""
    cost = CostModel(ModelShape.preset("opt-13b"), DEVICES["a100-40gb"])
    trace = [SimRequest([3] * 20, 10, 0.0, max_tokens=64) for _ in range(12)]
    runs = {a: simulate(trace, SimConfig(kv_allocator=a, num_blocks=60, block_size=4, max_model_len=128,
                                         admission_watermark=0.0), cost, keep_step_times=True)
            for a in ("paged", "oracle")}
    assert runs["paged"].num_steps < runs["oracle"].num_steps      # 12 at once vs 2-3 at a time
    assert runs["paged"].output_tokens_per_s > runs["oracle"].output_tokens_per_s
    assert runs["oracle"].num_steps >= 4 * 10   # at most 2 reservations of 84 tokens fit: 6 rounds of 10 steps
