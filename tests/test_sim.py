"""The step-time simulator: model shapes from configs, the cost model's arithmetic, and the
driver running the real scheduler and KV managers to the end on the simulated clock."""
import math
from pathlib import Path

import pytest

from pagedserve.models.presets import PRESETS
from pagedserve.sim import (DEVICES, EFFICIENCY_SOURCES, CostModel, Device, Efficiency, ModelShape, SimConfig,
                            SimRequest, StepWork, simulate, sustained_rate)
from pagedserve.sim.calibration import Calibration, fit_linear, interpolate
from pagedserve.sim.cost import TERMS


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
    assert (w.num_tokens, w.num_seqs, w.num_sampled, w.num_decodes, w.num_prefills) == (7, 3, 2, 1, 2)
    assert w.decode_pairs == 11                          # one query over 11 keys
    assert w.prefill_pairs == (1 + 2 + 3 + 4) + (7 + 8)  # causal: query i sees start + i + 1 keys
    assert w.prefill_kv_tokens == 4 + 8


# ---- the cost model, term by term: each test fails when its term is removed or scaled ---------------

TOY = Device("toy", matmul_flops=100e12, memory_bandwidth=1e12, memory_bytes=80 * 2**30, link_bandwidth=100e9,
             efficiency=Efficiency(matmul=0.5, attention=0.25, memory=0.8, attention_memory=0.5,
                                   paged_attention_penalty=1.25, allreduce=0.5, allreduce_latency_s=1e-5,
                                   step_overhead_s=1e-3, per_seq_overhead_s=1e-5), source="test")
OPT = ModelShape.preset("opt-13b")
L, H, F, V, B = OPT.num_layers, OPT.hidden_size, OPT.ffn_size, OPT.vocab_size, OPT.dtype_bytes


def _toy(**kw) -> CostModel:
    return CostModel(OPT, TOY, **kw)


def test_linear_layers_read_every_weight_once_or_run_at_the_matmul_rate():
    assert OPT.matrices == [(3 * H, H), (H, H), (F, H), (H, F)]
    one = _toy().step_time(StepWork.of([(100, 1)], 1))
    assert one.linear == pytest.approx(L * (3 * H * H + H * H + 2 * F * H) * B / (1e12 * 0.8))   # memory-bound
    big = _toy().step_time(StepWork.of([(0, 2000)], 1))
    assert big.linear == pytest.approx(2 * L * OPT.layer_params * 2000 / (100e12 * 0.5))       # compute-bound


def test_the_lm_head_runs_on_the_sampled_rows_only():
    one = _toy().step_time(StepWork.of([(0, 500)], 1))
    assert one.lm_head == pytest.approx(H * V * B / (1e12 * 0.8))
    many = _toy().step_time(StepWork.of([(100, 1)] * 2000, 2000))
    assert many.lm_head == pytest.approx(2 * H * V * 2000 / (100e12 * 0.5))
    assert _toy().step_time(StepWork.of([(0, 500)], 0)).lm_head == 0


def test_prefill_attention_is_its_causal_pairs_at_the_attention_rate():
    t = _toy().step_time(StepWork.of([(0, 2000)], 1))
    pairs = 2000 * 2001 / 2
    assert t.prefill_attention == pytest.approx(4 * OPT.num_heads * OPT.head_dim * L * pairs / (100e12 * 0.25))
    assert t.decode_attention == 0


def test_decode_attention_reads_the_kv_cache_and_paged_pays_its_penalty():
    work = StepWork.of([(999, 1)] * 64, 64)
    paged, contiguous = _toy().step_time(work), _toy(paged=False).step_time(work)
    assert contiguous.decode_attention == pytest.approx(64 * 1000 * OPT.kv_bytes_per_token / (1e12 * 0.5))
    assert paged.decode_attention == pytest.approx(1.25 * contiguous.decode_attention)
    assert paged.linear == contiguous.linear and paged.prefill_attention == 0


def test_element_wise_work_streams_the_activations_per_token():
    t = _toy().step_time(StepWork.of([(0, 1000)], 1))
    per_token = (8 * H + 2 * (H + H) + 3 * F + 4 * H) * B      # norms, RoPE, SiLU-and-mul, KV write
    assert t.elementwise == pytest.approx(L * per_token * 1000 / (1e12 * 0.8))


def test_sampling_reads_the_logits_of_each_sampled_row():
    t = _toy().step_time(StepWork.of([(10, 1)] * 8, 8))
    assert t.sampling == pytest.approx(3 * 4 * V * 8 / (1e12 * 0.8))


def test_tensor_parallelism_splits_the_work_and_adds_two_all_reduces_per_layer():
    work = StepWork.of([(0, 2000)], 1)
    one, four = _toy().step_time(work), _toy(tp=4).step_time(work)
    assert four.linear == pytest.approx(one.linear / 4) and one.allreduce == 0
    ring = 2 * 3 / 4 * 2000 * H * B / (100e9 * 0.5)
    assert four.allreduce == pytest.approx(2 * L * (ring + 1e-5))


def test_the_step_cost_is_fixed_plus_per_sequence():
    t = _toy().step_time(StepWork.of([(10, 1)] * 30, 30))
    assert t.overhead == pytest.approx(1e-3 + 30 * 1e-5)


def test_the_total_is_every_term_and_term_scale_scales_one():
    work = StepWork.of([(0, 300), (50, 1), (80, 1)], 2)
    base = _toy(tp=2).step_time(work)
    assert base.total == pytest.approx(sum(getattr(base, k) for k in TERMS))
    for term in TERMS:
        assert getattr(base, term) > 0, term
        scaled = _toy(tp=2, term_scale={term: 1.5}).step_time(work)
        assert scaled.total == pytest.approx(base.total + 0.5 * getattr(base, term)), term
    with pytest.raises(ValueError):
        _toy(term_scale={"attention": 2})


def test_gpu_presets_cite_every_factor_and_the_papers_paged_penalty():
    eff = DEVICES["a100-40gb"].efficiency
    assert 1.20 <= eff.paged_attention_penalty <= 1.26            # Kwon et al., Fig. 18a: 20-26% slower
    assert eff.attention_memory < eff.memory                      # attention below a pure stream
    for name in Efficiency.__dataclass_fields__:
        if getattr(eff, name) not in (0.0, 1.0):
            assert name in EFFICIENCY_SOURCES, name
    assert "Fig. 18a" in EFFICIENCY_SOURCES["paged_attention_penalty"]


def test_the_paged_penalty_slows_the_paged_cache_only():
    trace = _trace(40, math.inf)
    config = SimConfig(num_blocks=40, block_size=4, max_model_len=128, admission_watermark=0.0)
    shape = ModelShape.preset("opt-13b")
    runs = {p: simulate(trace, config, CostModel(shape, DEVICES["a100-40gb"].with_efficiency(
        paged_attention_penalty=p))) for p in (1.0, 1.23)}
    assert runs[1.23].num_steps == runs[1.0].num_steps and runs[1.23].busy_time_s > runs[1.0].busy_time_s
    oracle = SimConfig(kv_allocator="oracle", num_blocks=40, block_size=4, max_model_len=128)
    assert simulate(trace, oracle, CostModel(shape, DEVICES["a100-40gb"], paged=False)).busy_time_s == \
        pytest.approx(simulate(trace, oracle, CostModel(shape, DEVICES["a100-40gb"].with_efficiency(
            paged_attention_penalty=9.0), paged=False)).busy_time_s)


# ---- the local preset: measured terms ---------------------------------------------------------------

SMOL = ModelShape.preset("smollm2-135m", "bfloat16")


def _calibration() -> Calibration:
    linear = {f"{n}x{k}": [(1.0, 1e-5 * i), (64.0, 3e-5 * i), (256.0, 9e-5 * i)]
              for i, (n, k) in enumerate(SMOL.matrices, start=1)}
    return Calibration(linear=linear, lm_head=[(1.0, 1e-3), (64.0, 5e-3)],
                       decode_attention={"2": [1e-6, 2e-7, 3e-9], "16": [1e-6, 1e-7, 2e-9]},
                       contiguous_decode_attention=[1e-6, 1e-7, 1e-9], prefill_attention=[2e-6, 3e-6, 4e-11],
                       elementwise=[5e-6, 6e-8], elementwise_parts={}, sampling=[1e-4, 2e-6], step=[2e-3, 3e-5, 1e-7])


def _local(**kw) -> CostModel:
    dev = Device("local", 1e11, 1e10, 2**34, 0.0, Efficiency(), "test", _calibration())
    return CostModel(SMOL, dev, **kw)


def test_interpolation_and_fits():
    table = [(1.0, 1.0), (3.0, 5.0)]
    assert interpolate(table, 2.0) == pytest.approx(3.0) and interpolate(table, 5.0) == pytest.approx(9.0)
    assert fit_linear([((x, y), 1 + 2 * x + 3 * y) for x in (1, 2, 5) for y in (0, 4)]) == pytest.approx([1, 2, 3])


def test_measured_terms_are_the_calibrations_tables_and_fits():
    Lm = SMOL.num_layers
    decode = StepWork.of([(99, 1)] * 64, 64)
    t = _local(block_size=16).step_time(decode)
    assert t.linear == pytest.approx(Lm * sum(3e-5 * i for i in range(1, 5)))    # the 64-row points
    assert t.lm_head == pytest.approx(5e-3)
    assert t.decode_attention == pytest.approx(Lm * (1e-6 + 1e-7 * 64 + 2e-9 * 64 * 100))
    assert t.prefill_attention == 0
    assert t.elementwise == pytest.approx(Lm * (5e-6 + 6e-8 * 64))
    assert t.sampling == pytest.approx(1e-4 + 2e-6 * 64)
    assert t.overhead == pytest.approx(2e-3 + 3e-5 * 64 + 1e-7 * 64) and t.allreduce == 0
    # Block size and layout choose the attention fit.
    assert _local(block_size=2).step_time(decode).decode_attention == pytest.approx(
        Lm * (1e-6 + 2e-7 * 64 + 3e-9 * 6400))
    assert _local(paged=False).step_time(decode).decode_attention == pytest.approx(
        Lm * (1e-6 + 1e-7 * 64 + 1e-9 * 6400))
    prefill = _local().step_time(StepWork.of([(0, 100), (0, 50)], 2))
    assert prefill.prefill_attention == pytest.approx(Lm * (2e-6 + 3e-6 * 2 + 4e-11 * (5050 + 1275)))
    assert prefill.decode_attention == 0
    assert _calibration().paged_penalty(16, 64, 256) > 1.0
    with pytest.raises(ValueError):
        _local(tp=2)


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


def test_calibration_measures_the_engines_kernels_and_the_recorder_sees_each_step(tiny_llama):
    """sim/local.py on a tiny model: every shape of it measured (numbers not checked: timings);
    StepRecorder records each step's work and time, per op without the compiled layers, and puts
    the engine back as it was."""
    from pagedserve import LLM, SamplingParams
    from pagedserve.sim.local import CalibrationSizes, StepRecorder, fit_step_cost, local_device, measure_kernels
    llm = LLM(tiny_llama.path, dtype="float32", num_gpu_blocks_override=64, block_size=4)
    engine = llm.engine
    cal = measure_kernels(engine, CalibrationSizes.tiny(), log=lambda s: None)
    a = engine.model_args
    shape = ModelShape(name="tiny", num_layers=a.num_layers, hidden_size=a.hidden_size, num_heads=a.num_heads,
                       num_kv_heads=a.num_kv_heads, head_dim=a.head_dim, ffn_size=a.intermediate_size,
                       gated_mlp=True, vocab_size=a.vocab_size, tied_embeddings=a.tie_word_embeddings,
                       dtype_bytes=4)
    assert {f"{n}x{k}" for n, k in shape.matrices} == set(cal.linear)
    assert set(cal.decode_attention) == {"2", "16"} and len(cal.elementwise_parts) == 4
    model = engine.runner.model
    compiled = model.compiled_layers
    for ops in (False, True):
        model.compiled_layers = None if ops else compiled
        rec = StepRecorder(engine, ops=ops)
        prompts = [[5 + 100 * ops + 10 * i + j for j in range(5)] for i in range(3)]   # no prefix shared
        outs = llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
        records = rec.close()
        model.compiled_layers = compiled
        assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
        assert [r.work.num_tokens for r in records] == [15, 3, 3, 3]
        assert all(r.wall_s >= r.forward_s + r.lm_head_s + r.sampler_s > 0 for r in records)
        assert all(set(r.ops_s) == ({"linear", "attention", "elementwise"} if ops else set()) for r in records)
        assert "forward" not in model.__dict__ and "schedule" not in engine.scheduler.__dict__
        assert not engine.step_observers
    cost = CostModel(shape, local_device(cal), block_size=4)
    assert cost.step_time(records[1].work).total > 0 and len(fit_step_cost(records)) == 3
    # A layout the kernel refuses times nothing: the bench says so (the contiguous layout had been
    # one 512-token block, past the kernel's largest, and its "measurement" a refused call).
    from pagedserve.sim.local import CONTIGUOUS_BLOCK, _AttentionBench
    bench = _AttentionBench(model, 2 * CONTIGUOUS_BLOCK, 2 * CONTIGUOUS_BLOCK, 1)
    with pytest.raises(RuntimeError, match="refused"):
        bench.time([(9, 1, t) for t in bench.tables([10], contiguous=True)], 1)


def test_the_validation_fails_for_every_term_scaled_by_one_and_a_half():
    """benchmarks/sim_validate.py's verdict on engine records that the cost model prices exactly
    (made here from the model itself): it passes, and fails once any one term is scaled 1.5x."""
    from types import SimpleNamespace

    from benchmarks import sim_validate as sv
    from pagedserve.sim.local import StepRecord
    cal = _calibration()
    cal.call_overhead_s = 2e-6
    dev = Device("local", 1e11, 1e10, 2**34, 0.0, Efficiency(), "test", cal)
    cost_for = lambda bs, **kw: CostModel(SMOL, dev, block_size=bs, **kw)  # noqa: E731
    per_call = SMOL.num_layers * cal.call_overhead_s

    def record(work, bs=16, ops=False):
        t = cost_for(bs).step_time(work)
        r = StepRecord(work, t.total, t.linear + t.decode_attention + t.prefill_attention + t.elementwise,
                       t.lm_head, t.sampling)
        if ops:
            r.ops_s = {"linear": t.linear + 4 * per_call, "elementwise": t.elementwise + 5 * per_call,
                       "attention": t.decode_attention + t.prefill_attention + per_call}
            r.forward_s += 11 * per_call       # the Python loop's per-op calls (the element-wise check's 6 include its own)
        return r
    decode = StepWork.of([(200, 1)] * 48, 48)
    prefill = StepWork.of([(0, 200)] * 8, 8)
    decomposed = [record(prefill, ops=True)] * 3 + [record(decode, ops=True)] * 10
    runs = []
    for bs in (2, 16):
        trace = [SimRequest([3] * 30, 12) for _ in range(20)]
        config = SimConfig(num_blocks=400 // bs, block_size=bs, max_model_len=128)
        sim = simulate(trace, config, cost_for(bs))
        runs.append({"workload": "toy", "block_size": bs, "rate": math.inf, "saturated": True, "num_requests": 20,
                     "result": SimpleNamespace(duration_s=sim.duration_s, num_preemptions=sim.num_preemptions,
                                               avg_batch_size=sim.avg_batch_size),
                     "records": [record(prefill, bs)] + [record(decode, bs)] * 5, "sim_trace": trace,
                     "sim_config": config})
    assert sv.evaluate(cost_for, runs, decomposed)["passed"]
    for term in TERMS:
        if term == "allreduce":
            continue
        for scale in (1.5, 0.0):       # scaled, or removed
            verdict = sv.evaluate(lambda bs, t=term: cost_for(bs, term_scale={t: scale}), runs, decomposed)
            assert not verdict["passed"], (term, scale)
            assert not verdict["terms"][term]["ok"], (term, scale)      # the term's own check catches it


# ---- the in-step fit (sim/local.py fit_in_steps) and the offline evaluation (benchmarks/sim_fit.py) ----

def _true_step(cal: Calibration, work: StepWork, loop: float = 1.0) -> dict:
    """What the made-up engine's steps take: the micro-benchmarks' terms, each off by its own
    factor, as real steps are (linear 2x at up to 16 rows, 1.3x above; attention 1.4x and 1.1x;
    element-wise and the layer loop 2e-5 s + 1e-6 s/token per layer; the LM head 1.2x); `loop`:
    another layer loop's linear and element-wise time over the decomposed run's."""
    L = SMOL.num_layers
    g = 2.0 if work.num_tokens <= 16 else 1.3
    d, p = cal.decode_attention["16"], cal.prefill_attention
    return {"linear": loop * g * L * sum(interpolate(t, work.num_tokens) for t in cal.linear.values()),
            "attention": (1.4 * L * (d[0] + d[1] * work.num_decodes + d[2] * work.decode_pairs) if work.num_decodes
                          else 0.0) + (1.1 * L * (p[0] + p[1] * work.num_prefills + p[2] * work.prefill_pairs)
                                       if work.num_prefills else 0.0),
            "elementwise": loop * L * (2e-5 + 1e-6 * work.num_tokens),
            "lm_head": 1.2 * interpolate(cal.lm_head, work.num_sampled),
            "sampling": 5e-5 + 8e-6 * work.num_sampled,
            "outside": 3e-4 + 4e-5 * work.num_seqs + 1e-7 * work.num_tokens}


def _true_record(cal: Calibration, work: StepWork, ops: bool, loop: float = 1.0):
    from pagedserve.sim.local import StepRecord
    t = _true_step(cal, work, loop)
    forward = t["linear"] + t["attention"] + t["elementwise"]
    r = StepRecord(work, forward + t["lm_head"] + t["sampling"] + t["outside"], forward, t["lm_head"], t["sampling"])
    if ops:
        r.ops_s = {"linear": t["linear"], "attention": t["attention"], "elementwise": 0.8 * t["elementwise"]}
    return r


def test_the_in_step_fit_takes_each_term_as_the_engines_steps_ran_it():
    """fit_in_steps on made-up engine steps whose every term is off the micro-benchmarks by its
    own factor: the fitted model prices steps it never saw as those steps ran, term by term
    (the test fails if any term's fit is dropped or mis-scaled)."""
    from pagedserve.sim.local import fit_in_steps
    micro = _calibration()
    decode = lambda n, ctx: StepWork.of([(ctx, 1)] * n, n)  # noqa: E731
    decomposed = [_true_record(micro, StepWork.of([(0, 200)] * 8, 8), True) for _ in range(3)]
    decomposed += [_true_record(micro, decode(n, 150), True) for n in range(48, 0, -1)]
    calibration = [_true_record(micro, decode(n, 60 + n), False) for n in range(1, 120)]
    calibration += [_true_record(micro, StepWork.of([(0, 100)] * 20, 20), False)]
    fitted = fit_in_steps(micro, SMOL.num_layers, decomposed, calibration)
    dev = Device("local", 1e11, 1e10, 2**34, 0.0, Efficiency(), "test", fitted)
    cost = CostModel(SMOL, dev, block_size=16)
    for work in (decode(7, 300), decode(17, 90), decode(90, 40), StepWork.of([(0, 300)] * 4, 4)):
        t, true = cost.step_time(work), _true_step(micro, work)
        assert t.linear == pytest.approx(true["linear"], rel=1e-6)
        assert t.decode_attention + t.prefill_attention == pytest.approx(true["attention"], rel=1e-6)
        assert t.elementwise == pytest.approx(true["elementwise"], rel=1e-6)
        assert t.lm_head == pytest.approx(true["lm_head"], rel=1e-6)
        assert t.sampling == pytest.approx(true["sampling"], rel=1e-6)
        assert t.overhead == pytest.approx(true["outside"], rel=1e-6)
    # The contiguous layout and the other block sizes move with the paged kernel's factor.
    assert fitted.contiguous_decode_attention[2] == pytest.approx(1.4 * micro.contiguous_decode_attention[2])
    assert fitted.decode_attention["2"][2] == pytest.approx(1.4 * micro.decode_attention["2"][2])


def test_the_in_step_fit_carries_linear_and_elementwise_over_to_the_calibration_runs_layer_loop():
    """The calibration run runs the validated engine's layer loop (the compiled one), the
    decomposed run the Python one: here the former's linear and element-wise work take 0.6x the
    latter's at 1-2 rows and 0.8x above (the quiet recording's shape). The fitted model prices the
    compiled loop's steps as they ran, also at 1 row, which the calibration run never reached (its
    2-row factor), while the term checks still see the Python loop's terms on the decomposed run.
    Without the loop factors the decomposed run's linear factors price those steps 1.25-1.7x."""
    from benchmarks import sim_validate as sv
    from pagedserve.sim.local import fit_in_steps
    micro = _calibration()
    decode = lambda n, ctx: StepWork.of([(ctx, 1)] * n, n)  # noqa: E731
    loop = lambda w: 0.6 if w.num_tokens <= 2 else 0.8  # noqa: E731
    decomposed = [_true_record(micro, StepWork.of([(0, 200)] * 8, 8), True) for _ in range(3)]
    decomposed += [_true_record(micro, decode(n, 150), True) for n in range(48, 0, -1)]
    calibration = [_true_record(micro, w, False, loop(w)) for n in range(2, 120) for w in [decode(n, 60 + n)]]
    calibration += [_true_record(micro, w, False, loop(w)) for w in [StepWork.of([(0, 100)] * 20, 20)]]
    fitted = fit_in_steps(micro, SMOL.num_layers, decomposed, calibration)
    cost = CostModel(SMOL, Device("local", 1e11, 1e10, 2**34, 0.0, Efficiency(), "test", fitted), block_size=16)
    for work in (decode(1, 300), decode(2, 40), decode(7, 300), decode(17, 90), decode(40, 100), decode(90, 40)):
        t, true = cost.step_time(work), _true_step(micro, work, loop(work))
        assert t.linear + t.elementwise + t.decode_attention == pytest.approx(
            true["linear"] + true["elementwise"] + true["attention"], rel=1e-6), work.num_tokens
    terms = sv.term_checks(cost, decomposed, calibration)
    for term in ("linear", "decode_attention", "elementwise"):
        assert terms[term]["median_error"] == pytest.approx(0.0, abs=1e-6), term


def test_a_recording_notes_its_layer_loop_and_sim_fit_refits_for_it(tmp_path):
    """sim_fit --refit fits for the loop the recorded engine ran (sim_validate --calibrate does):
    the recording's note, else the compiled loop; --loop overrides."""
    from benchmarks import sim_fit
    from benchmarks.sim_validate import save_records
    save_records(tmp_path / "steps.json", [], [], compiled_loop=False)
    data = sim_fit.load_steps(tmp_path / "steps.json")
    assert data["compiled_loop"] is False and sim_fit.compiled_loop(data) is False
    assert sim_fit.compiled_loop(data, "compiled") is True
    assert sim_fit.compiled_loop({"decomposed": []}) is True and sim_fit.compiled_loop({}, "python") is False


def test_fit_linear_refits_without_a_negative_coefficient():
    """A coefficient that would come out negative is dropped and the rest refitted (clipping after
    one fit left the others fitted against it); relative=True weights small rows like large."""
    rows = [((x, 2 * x + (1 if x % 2 else -1) * 0.01), 5 + 3 * x) for x in range(1, 20)]
    c = fit_linear(rows)
    assert min(c) >= 0 and c[0] == pytest.approx(5, rel=0.05)
    assert fit_linear([((n,), 1e-4 + 1e-6 * n) for n in (1, 2, 4, 1000)], relative=True) == pytest.approx([1e-4, 1e-6])


_QUIET = Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def quiet_recording():
    """The quiet machine's recording (tests/data: its micro-benchmark calibration, its decomposed
    run, two saturated validation runs), the alpaca one standing in for the calibration run."""
    from benchmarks import sim_fit
    from benchmarks.sim_validate import fit_device
    from pagedserve.sim.local import load_local_device
    data = sim_fit.load_steps(_QUIET / "sim_steps_quiet.json.gz")
    micro = load_local_device(_QUIET / "sim_local_device_quiet.json")
    calibration, data = sim_fit.stand_in_calibration(data, "alpaca:16")
    decomposed = sim_fit.records_of(data["decomposed"])
    fitted = fit_device(micro, decomposed, calibration, SMOL, compiled_loop=False)
    return micro, fitted, decomposed, sim_fit.load_runs(data, SMOL.vocab_size)


def test_the_quiet_recording_validates_per_step_after_the_in_step_fit(quiet_recording):
    """Held out (the fit never saw it): the saturated ShareGPT-like run at block size 16, per step
    and in total, within the validation's bounds; the micro-benchmarks alone are too fast."""
    from benchmarks import sim_validate as sv
    micro, fitted, decomposed, runs = quiet_recording
    before = sv.evaluate(lambda bs, **kw: CostModel(SMOL, micro, block_size=bs, **kw), runs, decomposed)
    assert not before["passed"] and before["runs"][0]["step_error_median"] < -sv.STEP_MEDIAN_BOUND
    after = sv.evaluate(lambda bs, **kw: CostModel(SMOL, fitted, block_size=bs, **kw), runs, decomposed)
    run = after["runs"][0]
    assert after["passed"], after
    assert run["measured_steps"] == run["predicted_steps"] and run["measured_preemptions"] == run["predicted_preemptions"]
    # The fixed contiguous measurement is still the broken one in this recording; the fit keeps its shape.
    assert fitted.calibration.meta["in_step_fit"]["decode_attention_factor"] > 1


@pytest.mark.parametrize("scale", [1.5, 0.0])
def test_the_quiet_recordings_validation_fails_for_each_term_scaled_or_removed(quiet_recording, scale):
    from benchmarks import sim_validate as sv
    _, fitted, decomposed, runs = quiet_recording
    for term in TERMS:
        if term == "allreduce":
            continue
        v = sv.evaluate(lambda bs, **kw: CostModel(SMOL, fitted, block_size=bs, term_scale={term: scale}), runs,
                        decomposed)
        assert not v["passed"], (term, scale)
        assert not v["terms"][term]["ok"], (term, scale)


def test_a_mixture_of_experts_step_is_priced_by_the_experts_it_reads():
    """OLMoE-1B-7B's shape: all 64 experts resident, one token reads 8; a decode step of one token
    costs its active weights' bytes, a large batch every expert's."""
    cfg = dict(num_hidden_layers=16, hidden_size=2048, num_attention_heads=16, num_key_value_heads=16,
               intermediate_size=1024, num_experts=64, num_experts_per_tok=8, vocab_size=50304,
               tie_word_embeddings=False, torch_dtype="bfloat16")
    moe = ModelShape.from_config(cfg)
    assert (moe.sparse_layers, moe.dense_layers, moe.expert_ffn_size) == (16, 0, 1024)
    assert moe.weight_bytes / 2 / 1e9 == pytest.approx(6.9, abs=0.05)         # OLMoE-1B-7B: 6.9B in all
    assert moe.read_bytes(1) / 2 / 1e9 == pytest.approx(1.17, abs=0.05)       # ~1.3B active with the embedding
    assert moe.experts_read(1) == pytest.approx(8) and moe.experts_read(256) == pytest.approx(64)
    one = CostModel(moe, TOY).step_time(StepWork.of([(100, 1)], 1))
    expert = 3 * 2048 * 1024
    assert one.linear == pytest.approx(16 * (4 * 2048 * 2048 + 8 * expert) * 2 / (1e12 * 0.8))
    qwen = ModelShape.from_config({**cfg, "moe_intermediate_size": 512, "mlp_only_layers": [0],
                                   "decoder_sparse_step": 2})
    assert (qwen.sparse_layers, qwen.dense_layers, qwen.expert_ffn_size) == (8, 8, 512)
    dense = ModelShape.from_config({k: v for k, v in cfg.items() if k not in ("num_experts", "num_experts_per_tok")})
    assert dense.read_bytes(1) == dense.weight_bytes - dense.head_params * 2     # (the embedding is not read)
