"""Measured step-cost terms of one machine (the `local` preset): what sim/local.py's
micro-benchmarks of the engine's own kernels found, as tables and linear fits the cost model
evaluates. Pure data: no torch here, so the simulator runs without the engine.

Every time is in seconds. Per-layer terms are for one decoder layer (the cost model multiplies
by the number of layers); the LM head, sampling and the step cost are per step.
"""
from __future__ import annotations

import bisect
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path


def interpolate(table: list[tuple[float, float]], x: float) -> float:
    """Piecewise linear through (x, y) points sorted by x; beyond the ends, the end segments'
    slopes (so a term keeps growing with its work past the largest size measured)."""
    if not table:
        return 0.0
    if len(table) == 1:
        return table[0][1] * (x / table[0][0] if table[0][0] else 1.0)
    xs = [p[0] for p in table]
    i = min(max(bisect.bisect_left(xs, x), 1), len(table) - 1)
    (x0, y0), (x1, y1) = table[i - 1], table[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def interpolate_clamped(table: list[tuple[float, float]], x: float) -> float:
    """Piecewise linear through sorted (x, y) points, the end values beyond the ends (for
    factors, which must not run away outside the sizes they were measured at)."""
    if not table:
        return 1.0
    if x <= table[0][0]:
        return table[0][1]
    if x >= table[-1][0]:
        return table[-1][1]
    return interpolate(table, x)


def rescale(table: list[tuple[float, float]], factors: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """A micro-benchmark's table times measured/micro-benchmark factors at the sizes real steps
    ran (clamped beyond them): at those sizes the result is what the real steps took; between
    and beyond them, the micro-benchmark's shape."""
    if not factors:
        return list(table)
    xs = sorted({x for x, _ in table} | {x for x, _ in factors})
    return [(x, interpolate(table, x) * interpolate_clamped(factors, x)) for x in xs]


def fit_linear(rows: list[tuple[tuple[float, ...], float]], relative: bool = False) -> list[float]:
    """Least squares y = c0 + c1 x1 + c2 x2 + ... over (features, y) rows, no coefficient below 0
    (no term makes a step faster): a coefficient that comes out negative is set to 0 and the
    rest refitted without it (clipping it after one unconstrained fit would leave the others
    fitted against it). relative: minimise relative rather than absolute errors (each row
    weighted by 1 / y), so that the many small steps count as much as the few large ones."""
    import numpy as np
    if relative:
        rows = [r for r in rows if r[1] > 0]
    a = np.array([[1.0, *f] for f, _ in rows])
    y = np.array([t for _, t in rows])
    if relative:
        a, y = a / y[:, None], np.ones_like(y)
    active = list(range(a.shape[1]))
    coef = np.zeros(a.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(a[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    return [float(c) for c in coef]


@dataclass
class Calibration:
    """What one step's work costs on the machine it was measured on."""
    # (out_features, in_features) as "NxK" -> [(tokens, seconds)] of one matrix multiply.
    linear: dict[str, list[tuple[float, float]]]
    lm_head: list[tuple[float, float]]                  # [(sampled rows, seconds)]
    # Paged decode attention per layer, by block size: [c0, per sequence, per context token].
    decode_attention: dict[str, list[float]]
    contiguous_decode_attention: list[float]           # the same kernel, one block per sequence
    # Prefill attention per layer: [c0, per chunk, per (query, key) pair].
    prefill_attention: list[float]
    elementwise: list[float]                            # per layer: [c0, per token] (norms, RoPE, SiLU, KV write)
    elementwise_parts: dict[str, list[float]]           # the same, per kernel (reported)
    sampling: list[float]                               # per step: [c0, per sampled row]
    step: list[float]                 # per step outside the kernels: [c0, per sequence, per token]
    # One Python call of an op (wrapper, allocation, ctypes), taken out of the per-op times above:
    # the compiled layer loop does not pay it; the Python layer loop pays it once per op.
    call_overhead_s: float = 0.0
    # Element-wise per layer by tokens, as real engine steps ran it ([(tokens, seconds)]: the norms,
    # RoPE, SiLU-and-mul, KV write and the layer loop's Python between the kernels); used instead
    # of `elementwise` when present (sim/local.py fit_in_steps).
    elementwise_steps: list[tuple[float, float]] = field(default_factory=list)
    # Sampling per step by sampled rows as real steps ran it (the sampler switches paths with the
    # batch: no straight line fits it); used instead of `sampling` when present.
    sampling_steps: list[tuple[float, float]] = field(default_factory=list)
    # The layer loop the validated engine runs against the one the linear and element-wise terms
    # were fitted in (the decomposed run's Python loop), by tokens: [(tokens, its time / theirs)]
    # from the calibration run's steps (sim/local.py fit_in_steps), 1 where those terms were fitted
    # on the calibration run's own steps; clamped beyond the ends. Empty: the fitted loop's own.
    loop_factors: list[tuple[float, float]] = field(default_factory=list)
    source: str = ""
    meta: dict = field(default_factory=dict)            # model, dtype, threads, kernel variant, sizes

    def linear_time(self, out_features: int, in_features: int, tokens: float) -> float:
        key = f"{out_features}x{in_features}"
        if key not in self.linear:
            raise KeyError(f"no linear-layer measurement for shape {key} (measured: {', '.join(self.linear)})")
        return interpolate(self.linear[key], tokens)

    def elementwise_time(self, tokens: float) -> float:
        """One layer's element-wise work at this many tokens."""
        if self.elementwise_steps:
            return interpolate(self.elementwise_steps, tokens)
        return self.elementwise[0] + self.elementwise[1] * tokens

    def loop_factor(self, tokens: float) -> float:
        """The validated layer loop's linear and element-wise time / the fitted loop's, at this many tokens."""
        return interpolate_clamped(self.loop_factors, tokens) if self.loop_factors else 1.0

    def sampling_time(self, rows: float) -> float:
        """The sampler on this many rows, per step."""
        if self.sampling_steps:
            return interpolate(self.sampling_steps, rows)
        return self.sampling[0] + self.sampling[1] * rows

    def decode_coefficients(self, block_size: int | None) -> list[float]:
        """The paged kernel's fit at this block size (the nearest measured one below it, or
        the smallest), or the contiguous kernel's where block_size is None."""
        if block_size is None:
            return self.contiguous_decode_attention
        sizes = sorted(int(b) for b in self.decode_attention)
        below = [b for b in sizes if b <= block_size]
        return self.decode_attention[str(below[-1] if below else sizes[0])]

    def paged_penalty(self, block_size: int, num_seqs: int = 64, context: int = 256) -> float:
        """Paged / contiguous decode attention time at one batch (reported beside the GPU presets')."""
        def t(c):
            return c[0] + c[1] * num_seqs + c[2] * num_seqs * context
        contiguous = t(self.contiguous_decode_attention)
        return t(self.decode_coefficients(block_size)) / contiguous if contiguous > 0 else float("nan")

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "Calibration":
        d = dict(d)
        d["linear"] = {k: [tuple(p) for p in v] for k, v in d["linear"].items()}
        d["lm_head"] = [tuple(p) for p in d["lm_head"]]
        d["elementwise_steps"] = [tuple(p) for p in d.get("elementwise_steps", [])]
        d["sampling_steps"] = [tuple(p) for p in d.get("sampling_steps", [])]
        d["loop_factors"] = [tuple(p) for p in d.get("loop_factors", [])]
        return cls(**d)

    def save(self, path: Path | str) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(self.to_json(), indent=1))

    @classmethod
    def load(cls, path: Path | str) -> "Calibration":
        return cls.from_json(json.loads(Path(path).read_text()))

