"""The `local` device preset: every term of the step-time model measured on this machine by a
micro-benchmark of the engine's own kernels (the loaded model's packed weights, its ops, its
attention backend, its sampler), saved as JSON (benchmarks/results/local_device.json) and read
back by `load_local_device`.

- linear layers: each matrix shape of the model (Q/K/V fused, O, gate/up fused, down; for
  SmolLM2 the 576-wide ones) at 1 to `max_tokens` rows, timed call by call over all layers' own
  weights in the engine's order, so each call finds the caches as the engine's would;
- the LM head (`model.compute_logits`, the packed head and the float32 cast) by sampled rows;
- decode attention by batch, context and block size, the paged kernel over scattered blocks,
  and the same kernel over one contiguous block per sequence (the paged/contiguous ratio is
  reported); prefill attention by chunks and (query, key) pairs;
- element-wise kernels by tokens: add-RMSNorm (the residual add fused; two per layer), RoPE,
  SiLU-and-mul, the KV write;
- sampling: the engine's sampler on greedy rows;
- the step's cost outside the kernels (scheduling, batch preparation, output processing):
  fitted by `fit_step_cost` on an engine run recorded by `StepRecorder` (the step's wall time
  less its forward, LM head and sampler), since it is the engine's Python, not a kernel.
Times are medians of repeated calls (the engine runs on a loaded, shared cache: the best of
many calls would be optimistic).

The micro-benchmarks alone are too fast for real steps (on the 2-core machine, 17-23% per
saturated step, 30-40% on small ones): they run hot caches and one op at a time, where a step
runs each layer's weights after the other layers' and pays the layer loop's Python (at 1-5
rows the linear layers took 1.5-2x their micro-benchmarked time in the quiet recording; at 17-24
rows, past the quantized GEMV's switch to tiles, 1.4-1.9x the table interpolated between 16 and
32 rows). `fit_in_steps` therefore
rescales every term to what it took inside the steps of a calibration and a decomposed engine
run (never the runs that validate it); the micro-benchmarks keep the shape of each term
between and beyond the sizes those steps ran.
"""
from __future__ import annotations

import json
import math
import os
import random
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace

import torch

from pagedserve.sim.calibration import Calibration, fit_linear, interpolate, rescale
from pagedserve.sim.cost import StepWork
from pagedserve.sim.devices import Device, Efficiency
from pagedserve.utils import cdiv

CONTIGUOUS_BLOCK = 256     # the CPU attention kernel's largest block (kMaxBlock in kernels/csrc/attention/layout.h)
DEFAULT_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "local_device.json"


@dataclass
class CalibrationSizes:
    # 16 and 17 both: the quantized GEMV's integer dots stop at 16 rows (tiles above), and a table
    # interpolated across such a switch is wrong. Real steps' row counts come from fit_in_steps.
    tokens: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 17, 24, 32, 48, 64, 96, 128, 192, 256, 512,
                                                       1024, 2048])
    lm_rows: list[int] = field(default_factory=lambda: [1, 4, 16, 17, 32, 64, 128, 256])
    block_sizes: list[int] = field(default_factory=lambda: [2, 4, 8, 16, 32])
    batches: list[int] = field(default_factory=lambda: [1, 8, 32, 64, 128])
    contexts: list[int] = field(default_factory=lambda: [32, 128, 256, 512])
    chunks: list[tuple[int, int]] = field(default_factory=lambda: [(1, 16), (1, 64), (1, 256), (4, 64), (2, 512),
                                                                   (8, 128)])   # (chunks, tokens each)
    elementwise_tokens: list[int] = field(default_factory=lambda: [1, 16, 64, 256, 1024])
    sample_rows: list[int] = field(default_factory=lambda: [1, 16, 64, 128, 256])
    reps: int = 5
    attention_layers: int = 4     # distinct KV caches cycled through, so one call does not find the last's in cache

    @classmethod
    def quick(cls) -> "CalibrationSizes":
        return cls(tokens=[1, 4, 16, 17, 64, 128, 256, 1024], lm_rows=[1, 16, 17, 64, 256],
                   block_sizes=[2, 16],
                   batches=[1, 32, 128], contexts=[32, 256, 512], chunks=[(1, 16), (1, 256), (4, 64), (2, 512)],
                   elementwise_tokens=[1, 64, 1024], sample_rows=[1, 64, 256], reps=3)

    @classmethod
    def tiny(cls) -> "CalibrationSizes":
        """Checks that it runs (numbers meaningless)."""
        return cls(tokens=[1, 8, 32], lm_rows=[1, 8], block_sizes=[2, 16], batches=[1, 4], contexts=[16, 64],
                   chunks=[(1, 16), (2, 32)], elementwise_tokens=[1, 32], sample_rows=[1, 8], reps=1,
                   attention_layers=2)


def _median_time(fn, reps: int) -> float:
    fn()   # warm up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _shape(w) -> tuple[int, int]:
    """(out_features, in_features) of a plain or packed weight."""
    return (w.out_features, w.in_features) if hasattr(w, "out_features") else tuple(w.shape)


def measure_call_overhead(model, reps: int = 200) -> float:
    """One op call from Python with next to no work: a [1, 16] x [32, 16] product through the
    model's ops (its weight packed as the model's are): the wrapper, the output's allocation and
    the ctypes call, which each per-op time below includes and the compiled layer loop does not."""
    w = torch.randn(32, 16, dtype=model.dtype)
    if not isinstance(model.layers[0].qkv, torch.Tensor):          # the model's weights are packed
        from pagedserve.kernels import cpu
        w = cpu.pack_weight(w)
    x = torch.randn(1, 16, dtype=model.dtype)
    return _median_time(lambda: model.ops.linear(x, w), reps)


def _less(t: float, overhead: float) -> float:
    return max(t - overhead, 0.0)


def measure_linear(model, tokens: list[int], reps: int, call_s: float = 0.0) -> dict[str, list[tuple[float, float]]]:
    """Per matrix shape: [(rows, seconds per call)], each call timed in a pass over all layers in
    the engine's order (qkv, o, gate_up, down), on the model's own packed weights; less call_s."""
    ops, dtype = model.ops, model.dtype
    out: dict[str, list[tuple[float, float]]] = {}
    for t in tokens:
        per_shape: dict[str, list[float]] = {}
        inputs = {}
        # Past 256 rows a pass takes seconds and its 30 calls per shape vary little: fewer passes.
        for rep in range((reps if t <= 256 else max(1, reps // 2)) + 1):     # the first pass warms up
            for w in model.layers:
                for weight in (w.qkv, w.o, w.gate_up, w.down):
                    n, k = _shape(weight)
                    x = inputs.get(k)
                    if x is None:
                        x = inputs[k] = torch.randn(t, k, dtype=dtype)
                    t0 = time.perf_counter()
                    ops.linear(x, weight)
                    dt = time.perf_counter() - t0
                    if rep:
                        per_shape.setdefault(f"{n}x{k}", []).append(dt)
        for key, times in per_shape.items():
            out.setdefault(key, []).append((float(t), _less(statistics.median(times), call_s)))
    return out


def measure_lm_head(model, rows: list[int], reps: int) -> list[tuple[float, float]]:
    h = model.args.hidden_size
    return [(float(r), _median_time(lambda x=torch.randn(r, h, dtype=model.dtype): model.compute_logits(x), reps))
            for r in rows]


def _attention_meta(seqs: list[tuple[int, int, list[int]]], block_size: int):
    """AttentionMetadata for (start, new tokens, block table) per sequence, decodes first (as
    the runner builds it)."""
    from pagedserve.attention.metadata import AttentionMetadata
    slots, qsl, lens, tables = [], [0], [], []
    for start, n, table in seqs:
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, start + n))
        qsl.append(qsl[-1] + n)
        lens.append(start + n)
        tables.append(table)
    width = max(len(t) for t in tables)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long), query_start_loc=torch.tensor(qsl, dtype=torch.long),
        seq_lens=torch.tensor(lens, dtype=torch.long),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long),
        num_decodes=sum(1 for _, n, _ in seqs if n == 1), query_start_loc_cpu=qsl, seq_lens_cpu=lens,
        max_seq_len=max(lens))


class _AttentionBench:
    """The model's attention backend over a few layers' worth of KV cache in the runner's layout."""

    def __init__(self, model, block_size: int, num_tokens: int, layers: int, call_s: float = 0.0) -> None:
        from pagedserve.worker.model_runner import ModelRunner
        a = model.args
        self.call_s = call_s
        self.model, self.block_size = model, block_size
        self.num_blocks = cdiv(num_tokens, block_size) + 1
        self.caches = ModelRunner._allocate(SimpleNamespace(num_layers=layers, num_kv_heads=a.num_kv_heads,
                                                            head_dim=a.head_dim), self.num_blocks, block_size,
                                            model.dtype, torch.device("cpu"), model.attention.head_major_cache,
                                            model.attention.kv_format)
        self.caches.normal_()

    def tables(self, lengths: list[int], contiguous: bool) -> list[list[int]]:
        """Block tables: scattered blocks (a shuffled pool, as a cache in use has), or in order."""
        ids = list(range(1, self.num_blocks))
        if not contiguous:
            random.Random(0).shuffle(ids)
        out, i = [], 0
        for n in lengths:
            k = cdiv(n, self.block_size)
            out.append(ids[i:i + k])
            i += k
        return out

    def time(self, seqs: list[tuple[int, int, list[int]]], reps: int) -> float:
        """Seconds per layer of attention (the keys and values already in place), for these
        (start, new tokens, table)."""
        m, a = self.model, self.model.args
        meta = _attention_meta(seqs, self.block_size)
        t = meta.slot_mapping.shape[0]
        q = torch.randn(t, a.num_heads, a.head_dim, dtype=m.dtype)
        attention = m.attention
        if hasattr(attention, "kernel_rows"):       # the CPU backend: its compiled kernel alone
            from pagedserve.kernels import cpu
            rows = attention.kernel_rows(meta)
            calls = [lambda c=c: cpu.paged_attention(q, c, rows, m.scale) for c in self.caches]
            if cpu.paged_attention(q, self.caches[0], rows, m.scale) is None:
                raise RuntimeError(f"the attention kernel refused block size {self.block_size}: nothing to time")
        else:
            k = torch.randn(t, a.num_kv_heads, a.head_dim, dtype=m.dtype)
            calls = [lambda c=c: attention.forward(q, k, k, c, meta, m.scale) for c in self.caches]
        return _less(_median_time(lambda: [f() for f in calls], reps) / len(calls), self.call_s)


def measure_decode_attention(model, sizes: CalibrationSizes,
                             call_s: float = 0.0) -> tuple[dict[str, list[float]], list[float], dict]:
    """Fits c0 + c1 * seqs + c2 * keys per layer, per block size and for the contiguous layout:
    each sequence's keys in consecutive blocks of the largest size the kernel takes
    (CONTIGUOUS_BLOCK), in order (a block of the longest context would be refused by the kernel,
    and a refused call times nothing: the bench raises)."""
    most = max(sizes.batches) * max(sizes.contexts)
    paged, points = {}, {}
    for bs in [*sizes.block_sizes, None]:
        bench = _AttentionBench(model, bs or min(CONTIGUOUS_BLOCK, max(sizes.contexts)), most,
                                sizes.attention_layers, call_s)
        rows = []
        for b in sizes.batches:
            for c in sizes.contexts:
                tables = bench.tables([c] * b, contiguous=bs is None)
                t = bench.time([(c - 1, 1, tab) for tab in tables], sizes.reps)
                rows.append(((b, b * c), t))
        points[str(bs or "contiguous")] = [[b, k, t] for (b, k), t in rows]
        fit = fit_linear(rows)
        if bs is None:
            contiguous = fit
        else:
            paged[str(bs)] = fit
    return paged, contiguous, points


def measure_prefill_attention(model, sizes: CalibrationSizes, block_size: int = 16,
                              call_s: float = 0.0) -> tuple[list[float], list]:
    """Fits c0 + c1 * chunks + c2 * (query, key) pairs per layer, chunks starting at 0."""
    most = max(k * n for k, n in sizes.chunks)
    bench = _AttentionBench(model, block_size, most, sizes.attention_layers, call_s)
    rows = []
    for k, n in sizes.chunks:
        tables = bench.tables([n] * k, contiguous=False)
        t = bench.time([(0, n, tab) for tab in tables], sizes.reps)
        rows.append(((k, k * n * (n + 1) / 2), t))
    return fit_linear(rows), [[k, p, t] for (k, p), t in rows]


def measure_elementwise(model, tokens: list[int], reps: int, call_s: float = 0.0) -> dict[str, list[float]]:
    """Per kernel, c0 + c1 * tokens per call: add-RMSNorm (x += y, then the norm), RoPE in place
    in the fused qkv rows, SiLU-and-mul, the KV write into scattered slots."""
    ops, a, dtype = model.ops, model.args, model.dtype
    h, q, kv, f = a.hidden_size, a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.intermediate_size
    w = model.layers[0]
    rows: dict[str, list] = {"add_rms_norm": [], "rope": [], "silu_and_mul": [], "kv_write": []}
    bench = _AttentionBench(model, 16, max(tokens), 1)
    for t in tokens:
        x, y = torch.randn(t, h, dtype=dtype), torch.randn(t, h, dtype=dtype) * 1e-3
        qkv = torch.randn(t, q + 2 * kv, dtype=dtype)
        positions = torch.arange(t)
        cos, sin = model.rope.lookup(positions)
        gate_up = torch.randn(t, 2 * f, dtype=dtype)
        k = torch.randn(t, a.num_kv_heads, a.head_dim, dtype=dtype)
        slots = torch.randperm(bench.num_blocks * 16)[:t]
        rows["add_rms_norm"].append(((t,), _median_time(lambda: ops.add_rms_norm(x, y, w.post_norm, a.rms_norm_eps),
                                                       reps)))
        rows["rope"].append(((t,), _median_time(lambda: ops.rotate_queries_and_keys(
            qkv, a.num_heads, a.num_kv_heads, a.head_dim, cos, sin), reps)))
        rows["silu_and_mul"].append(((t,), _median_time(lambda: ops.silu_and_mul(gate_up), reps)))
        rows["kv_write"].append(((t,), _median_time(lambda: model.attention.write_kv(bench.caches[0], k, k, slots),
                                                   reps)))
    return {name: fit_linear([(f, _less(t, call_s)) for f, t in r]) for name, r in rows.items()}


def measure_sampling(sampler, vocab_size: int, rows: list[int], reps: int) -> list[float]:
    """The engine's sampler on greedy rows (the validation's requests): c0 + c1 * rows."""
    from pagedserve.batch import SamplingSettings
    from pagedserve.sampling.sampler import SamplingRow
    settings = SamplingSettings(ignore_eos=True)
    points = []
    for n in rows:
        logits = torch.randn(n, vocab_size)
        sample_rows = [SamplingRow(settings, 5, None, None, None) for _ in range(n)]
        points.append(((n,), _median_time(lambda: sampler(logits.clone(), sample_rows), reps)
                       - _median_time(lambda: logits.clone(), reps)))
    return fit_linear(points)


def measure_kernels(engine, sizes: CalibrationSizes | None = None, log=print) -> Calibration:
    """Every kernel term, on `engine`'s loaded model; the step cost is left at zero (fit_step_cost)."""
    sizes = sizes or CalibrationSizes()
    model = engine.runner.model
    t0 = time.perf_counter()
    call_s = measure_call_overhead(model)
    linear = measure_linear(model, sizes.tokens, sizes.reps, call_s)
    log(f"  linear layers {', '.join(linear)} ({time.perf_counter() - t0:.0f}s)")
    lm_head = measure_lm_head(model, sizes.lm_rows, sizes.reps)
    paged, contiguous, decode_points = measure_decode_attention(model, sizes, call_s)
    prefill, prefill_points = measure_prefill_attention(model, sizes, call_s=call_s)
    log(f"  attention ({time.perf_counter() - t0:.0f}s)")
    parts = measure_elementwise(model, sizes.elementwise_tokens, sizes.reps, call_s)
    per_layer = [sum(c[i] * (2 if name == "add_rms_norm" else 1) for name, c in parts.items()) for i in (0, 1)]
    sampling = measure_sampling(engine.runner.sampler, model.args.vocab_size, sizes.sample_rows, sizes.reps)
    log(f"  element-wise, sampling ({time.perf_counter() - t0:.0f}s)")
    from pagedserve.kernels import cpu
    meta = {"model": str(getattr(engine, "model_path", "")), "dtype": str(model.dtype).removeprefix("torch."),
            "threads": torch.get_num_threads(), "kernel_variant": cpu.variant(), "sizes": sizes.__dict__,
            "decode_attention_points": decode_points, "prefill_attention_points": prefill_points,
            "measured_at": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    return Calibration(linear=linear, lm_head=lm_head, decode_attention=paged, contiguous_decode_attention=contiguous,
                       prefill_attention=prefill, elementwise=per_layer, elementwise_parts=parts, sampling=sampling,
                       step=[0.0, 0.0, 0.0], call_overhead_s=call_s,
                       source="sim/local.py micro-benchmarks of the engine's kernels", meta=meta)


# ---- the engine's own steps ------------------------------------------------------------------------

@dataclass
class StepRecord:
    work: StepWork
    wall_s: float
    forward_s: float = 0.0      # model.forward (the compiled layer loop, or the Python one)
    lm_head_s: float = 0.0
    sampler_s: float = 0.0
    ops_s: dict[str, float] = field(default_factory=dict)   # per term, when recording ops (decomposed)

    @property
    def outside_kernels_s(self) -> float:
        return self.wall_s - self.forward_s - self.lm_head_s - self.sampler_s


class StepRecorder:
    """Records each engine step's work (what the scheduler planned) and wall time (from the
    planning to the end of the step: LLMEngine.step_observers), and the time in the model's
    forward, LM head and the sampler, by wrapping those objects' methods (nothing in the engine
    changes). `ops=True` also times each op of the Python layer loop (the engine must run without
    its compiled layers): linear, attention (decode and prefill together), element-wise."""

    def __init__(self, engine, ops: bool = False) -> None:
        self.engine, self.records = engine, []
        self._t0, self._cur = 0.0, None
        self._restore: list[tuple[object, str, object]] = []
        sched = engine.scheduler
        schedule = sched.schedule

        def recorded_schedule():
            self._t0 = time.perf_counter()
            out = schedule()
            self._cur = StepRecord(StepWork.of(((s.start, s.num_new_tokens) for s in out.scheduled),
                                               len(out.sampled)), 0.0)
            return out
        self._set(sched, "schedule", recorded_schedule)
        runner = engine.runner
        model = runner.model
        self._in_head = False
        self._timed(model, "forward", "forward_s")
        self._timed(model, "compute_logits", "lm_head_s", head=True)
        self._timed(runner, "sampler", "sampler_s")
        if ops:
            for name, term in (("linear", "linear"), ("add_rms_norm", "elementwise"),
                               ("rotate_queries_and_keys", "elementwise"), ("silu_and_mul", "elementwise")):
                self._timed(model.ops, name, term, op=True)
            self._timed(model.attention, "forward", "attention", op=True)
            self._timed(model.attention, "write_kv", "kv_write", op=True)
        engine.step_observers.append(self._observe)

    def _set(self, obj, name: str, fn) -> None:
        self._restore.append((obj, name, obj.__dict__.get(name, _MISSING)))
        setattr(obj, name, fn)

    def _timed(self, obj, name: str, slot: str, head: bool = False, op: bool = False) -> None:
        fn = getattr(obj, name)

        def timed(*args, **kwargs):
            if op and self._in_head:          # the LM head's own linear call: not a layer's
                return fn(*args, **kwargs)
            self._in_head |= head
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                cur = self._cur
                if cur is not None:
                    if op:
                        cur.ops_s[slot] = cur.ops_s.get(slot, 0.0) + dt
                    else:
                        setattr(cur, slot, getattr(cur, slot) + dt)
                if head:
                    self._in_head = False
        self._set(obj, name, timed)

    def _observe(self) -> None:
        cur, self._cur = self._cur, None
        if cur is None or cur.work.num_tokens == 0:
            return
        cur.wall_s = time.perf_counter() - self._t0
        if cur.ops_s:
            ops = cur.ops_s
            ops["attention"] = ops.get("attention", 0.0) - ops.get("kv_write", 0.0)
            ops["elementwise"] = ops.get("elementwise", 0.0) + ops.pop("kv_write", 0.0)
        self.records.append(cur)

    def close(self) -> list[StepRecord]:
        if self._observe in self.engine.step_observers:
            self.engine.step_observers.remove(self._observe)
        for obj, name, old in reversed(self._restore):
            if old is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, old)
        self._restore.clear()
        return self.records


_MISSING = object()


def fit_step_cost(records: list[StepRecord]) -> list[float]:
    """The step's time outside the kernels (scheduling, the batch's tensors, output processing):
    c0 + c1 * sequences + c2 * tokens, over recorded engine steps (relative errors: most steps
    are small)."""
    return fit_linear([((r.work.num_seqs, r.work.num_tokens), r.outside_kernels_s) for r in records], relative=True)


def _median_by(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """(x, y) points -> sorted (x, median y at that x)."""
    by: dict[float, list[float]] = {}
    for x, y in points:
        by.setdefault(float(x), []).append(y)
    return [(x, statistics.median(ys)) for x, ys in sorted(by.items())]


def _factors(measured: list[tuple[float, float]], predicted) -> list[tuple[float, float]]:
    """measured / predicted(x) at each x of the (x, median measured) points."""
    return [(x, m / p) for x, m in measured if (p := predicted(x)) > 0 and m > 0]


def fit_in_steps(cal: Calibration, num_layers: int, decomposed: list[StepRecord], steps: list[StepRecord],
                 per_call_s: float = 0.0, block_size: int = 16) -> Calibration:
    """The calibration as real engine steps ran it: each micro-benchmarked term rescaled to the
    time that term took inside the steps of engine runs, which run each layer's weights after
    the other layers' and pay the Python layer loop (the micro-benchmarks run hot caches and one
    op at a time). Never fit on the runs that validate the model.

    - decomposed: steps of the Python layer loop with each op timed (StepRecorder(ops=True)):
      linear (by tokens: measured / micro-benchmark factors, so the tables keep their shape
      between the sizes the steps ran), element-wise per layer by tokens (the norms, RoPE,
      SiLU, KV write and the loop's Python between the ops: the forward less its linear and
      attention), decode and prefill attention (one factor each, on the steps that are mostly
      one or the other; every block size and the contiguous layout scaled alike);
    - steps: plain engine steps (a calibration run), with the decomposed run's: the LM head and
      sampling by sampled rows (tables of the steps' medians), and the step cost outside the
      model (fit_step_cost, the calibration run's alone); and, since they run the validated
      engine's layer loop (the compiled one) where the decomposed run runs the Python one, the
      loop factors (Calibration.loop_factors): their linear and element-wise time over the
      decomposed run's, by tokens, at the row counts both ran.
    per_call_s: taken out of each op's time where the validated engine runs the compiled layer
    loop (which has no per-op Python call); 0 where it runs the Python loop, as the decomposed
    run does."""
    L = num_layers
    ops = [r for r in decomposed if r.ops_s]
    linear = {k: list(v) for k, v in cal.linear.items()}
    meta = dict(cal.meta)
    fit: dict = {"decomposed_steps": len(ops), "calibration_steps": len(steps), "per_call_s": per_call_s}
    if ops:
        def micro_linear(t: float) -> float:
            return L * sum(interpolate(table, t) for table in cal.linear.values())
        lin = _median_by([(r.work.num_tokens, r.ops_s.get("linear", 0.0) - 4 * L * per_call_s) for r in ops])
        elem = _median_by([(r.work.num_tokens, (r.forward_s - r.ops_s.get("linear", 0.0) - r.ops_s.get("attention", 0.0)
                                                - 6 * L * per_call_s) / L) for r in ops])
        fit["elementwise_steps"] = elem
    dec, pre = cal.decode_attention, cal.prefill_attention
    contiguous = cal.contiguous_decode_attention
    d16 = cal.decode_coefficients(block_size)

    def attention_factor(pick) -> float | None:
        ratios = []
        for r in ops:
            w = r.work
            d = L * (d16[0] + d16[1] * w.num_decodes + d16[2] * w.decode_pairs) if w.num_decodes else 0.0
            p = L * (pre[0] + pre[1] * w.num_prefills + pre[2] * w.prefill_pairs) if w.num_prefills else 0.0
            if pick(d, p) >= 0.8 * (d + p) > 0:
                ratios.append((r.ops_s.get("attention", 0.0) - L * per_call_s) / (d + p))
        return statistics.median(ratios) if ratios else None
    fd = attention_factor(lambda d, p: d)
    fp = attention_factor(lambda d, p: p)
    if fd:
        dec = {k: [c * fd for c in v] for k, v in dec.items()}
        contiguous = [c * fd for c in contiguous]
    if fp:
        pre = [c * fp for c in pre]
    fit.update(decode_attention_factor=fd, prefill_attention_factor=fp)
    if ops:
        # Row counts the decomposed run did not reach: the calibration run's steps, their forward
        # less the element-wise and attention terms just fitted (the same layer loop).
        seen = {x for x, _ in lin}
        elementwise_steps = fit["elementwise_steps"]
        d_fit, p_fit = [c * (fd or 1.0) for c in d16], [c * (fp or 1.0) for c in pre]

        def others(w: StepWork) -> float:
            d = d_fit[0] + d_fit[1] * w.num_decodes + d_fit[2] * w.decode_pairs if w.num_decodes else 0.0
            p = p_fit[0] + p_fit[1] * w.num_prefills + p_fit[2] * w.prefill_pairs if w.num_prefills else 0.0
            return L * (interpolate(elementwise_steps, w.num_tokens) + d + p)
        extra = _median_by([(r.work.num_tokens, r.forward_s - others(r.work)) for r in steps
                            if r.work.num_tokens not in seen and r.forward_s > 0])
        factors = _factors(sorted(lin + extra), micro_linear)
        linear = {k: rescale(v, factors) for k, v in cal.linear.items()}
        fit["linear_factors"] = factors
        # The calibration run runs the validated engine's layer loop (the compiled one, where the
        # model has it), the decomposed run the Python one, which pays per op and per layer what the
        # compiled loop does not, and not alike at every row count (in the quiet recording the compiled
        # loop's forward was 0.6x the Python loop's at 1-2 rows and 0.8x at 33-48). Where both ran a
        # row count: the calibration steps' forward less attention, over the linear and element-wise
        # terms just fitted on the decomposed run; 1 where the linear factors came from these steps.
        def loop_ratio(r: StepRecord) -> float:
            w, elem = r.work, L * interpolate(elementwise_steps, r.work.num_tokens)
            fitted = L * sum(interpolate(t, w.num_tokens) for t in linear.values()) + elem
            return (r.forward_s - (others(w) - elem)) / fitted
        ratios = [(r.work.num_tokens, loop_ratio(r) if r.work.num_tokens in seen else 1.0)
                  for r in steps if r.forward_s > 0]
        fit["loop_factors"] = _median_by(ratios)
    both = ops + list(steps)
    lm_head, sampling, step = cal.lm_head, cal.sampling, cal.step
    sampled = [r for r in both if r.work.num_sampled]
    if sampled:
        head = _median_by([(r.work.num_sampled, r.lm_head_s) for r in sampled])
        lm_head = rescale(cal.lm_head, _factors(head, lambda n: interpolate(cal.lm_head, n)))
        sampling = fit_linear([((r.work.num_sampled,), r.sampler_s) for r in sampled], relative=True)
        fit["sampling_steps"] = _median_by([(r.work.num_sampled, r.sampler_s) for r in sampled])
    if steps:
        step = fit_step_cost(list(steps))
    meta["in_step_fit"] = fit
    return replace(cal, linear=linear, lm_head=lm_head, decode_attention=dec, contiguous_decode_attention=contiguous,
                   prefill_attention=pre, sampling=sampling, step=step,
                   elementwise_steps=fit.get("elementwise_steps", list(cal.elementwise_steps)),
                   sampling_steps=fit.get("sampling_steps", list(cal.sampling_steps)),
                   loop_factors=fit.get("loop_factors", list(cal.loop_factors)), meta=meta,
                   source=cal.source + "; rescaled to real engine steps (fit_in_steps)")


# ---- the preset ------------------------------------------------------------------------------------

def local_device(calibration: Calibration) -> Device:
    """A Device around a calibration; its nominal rates (reported, not used by the cost model)
    from the largest matrix: FLOP/s at the most rows, bytes/s of its weight at one row."""
    key = max(calibration.linear, key=lambda k: math.prod(int(v) for v in k.split("x")))
    n, k = (int(v) for v in key.split("x"))
    table = calibration.linear[key]
    rows, t_big = table[-1]
    flops = 2 * rows * n * k / max(t_big, 1e-12)
    dtype_bytes = 4 if calibration.meta.get("dtype") == "float32" else 2
    bandwidth = n * k * dtype_bytes / max(table[0][1], 1e-12)
    memory = 0
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        pass
    return Device("local", flops, bandwidth, memory, 0.0, Efficiency(),
                  f"measured on this machine ({calibration.meta.get('threads')} threads, "
                  f"{calibration.meta.get('dtype')}, kernels {calibration.meta.get('kernel_variant')})",
                  calibration)


def save_local_device(device: Device, path: Path | str = DEFAULT_PATH) -> None:
    d = {k: v for k, v in device.__dict__.items() if k not in ("efficiency", "calibration")}
    d["efficiency"] = device.efficiency.__dict__
    d["calibration"] = device.calibration.to_json() if device.calibration else None
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(d, indent=1))


def load_local_device(path: Path | str | None = None) -> Device:
    path = Path(path or DEFAULT_PATH)
    if not path.exists():
        raise FileNotFoundError(f"no measured local preset at {path}: run benchmarks/sim_validate.py --calibrate")
    d = json.loads(path.read_text())
    d["efficiency"] = Efficiency(**d["efficiency"])
    cal = d.get("calibration")
    d["calibration"] = Calibration.from_json(cal) if cal else None
    if d["calibration"] is None:
        raise ValueError(f"{path} predates the measured terms (no 'calibration'): run "
                         "benchmarks/sim_validate.py --calibrate")
    return Device(**d)


def with_step_cost(device: Device, step: list[float]) -> Device:
    return replace(device, calibration=replace(device.calibration, step=list(step)))
