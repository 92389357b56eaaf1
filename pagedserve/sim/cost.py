"""Step time from what a step computes: one term per class of work.

The terms (`StepTime`): linear layers (by matrix shape), the LM head, prefill attention,
decode attention (by batch, context and block size; paged or contiguous), element-wise work
(RMSNorm, RoPE, SiLU-and-mul, residual adds, KV writes), sampling, the tensor-parallel
all-reduces, and the step's cost outside the kernels (fixed, plus per sequence).

Two ways to price a term, chosen by the device:
- a GPU preset (devices.py): a roofline per term, the longer of its FLOPs at the
  (efficiency-scaled) compute rate and its bytes at the (efficiency-scaled) bandwidth; paged
  decode attention pays the preset's published paged/contiguous penalty;
- the `local` preset: the device carries a `Calibration` (sim/local.py measured the engine's
  own kernels on this machine), and each term is its measured table or fit.
`CostModel(term_scale=...)` multiplies chosen terms (the validation's mutation check).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields

from pagedserve.sim.calibration import interpolate
from pagedserve.sim.devices import Device
from pagedserve.sim.shapes import ModelShape

TERMS = ("linear", "lm_head", "prefill_attention", "decode_attention", "elementwise", "sampling", "allreduce",
         "overhead")


@dataclass(frozen=True)
class StepWork:
    """What one step computes, from the scheduler's output: per sequence, its start position
    and how many tokens it computes; and how many sequences sample."""
    num_tokens: int = 0             # new tokens, all sequences
    num_sampled: int = 0
    prefill_pairs: float = 0.0      # (query, key) pairs of multi-token chunks (causal)
    prefill_kv_tokens: int = 0      # context tokens those chunks read
    decode_pairs: int = 0           # single-token sequences: their contexts (keys read)
    num_seqs: int = 0
    num_decodes: int = 0            # single-token sequences
    num_prefills: int = 0           # multi-token chunks

    @classmethod
    def of(cls, seqs: Iterable[tuple[int, int]], num_sampled: int) -> "StepWork":
        """seqs: (start, num_new_tokens) of each scheduled sequence."""
        tokens = seqs_n = decode = prefill_kv = decodes = 0
        prefill = 0.0
        for start, n in seqs:
            tokens += n
            seqs_n += 1
            end = start + n
            if n == 1:
                decode += end
                decodes += 1
            else:
                prefill += n * start + n * (n + 1) / 2    # query i attends to start + i + 1 keys
                prefill_kv += end
        return cls(tokens, num_sampled, prefill, prefill_kv, decode, seqs_n, decodes, seqs_n - decodes)


@dataclass(frozen=True)
class StepTime:
    linear: float
    lm_head: float
    prefill_attention: float
    decode_attention: float
    elementwise: float
    sampling: float
    allreduce: float
    overhead: float

    @property
    def total(self) -> float:
        return sum(getattr(self, f.name) for f in fields(self))


class CostModel:
    """paged: decode attention runs the paged kernel (False: the contiguous baselines' kernel);
    block_size: the paged cache's (the local preset's attention fit depends on it)."""

    def __init__(self, model: ModelShape, device: Device, tp: int = 1, paged: bool = True, block_size: int = 16,
                 term_scale: Mapping[str, float] | None = None) -> None:
        if tp < 1:
            raise ValueError(f"tp must be >= 1, got {tp}")
        unknown = set(term_scale or ()) - set(TERMS)
        if unknown:
            raise ValueError(f"unknown cost terms {sorted(unknown)}; the terms are {', '.join(TERMS)}")
        if device.calibration is not None and tp > 1:
            raise ValueError("a measured (local) preset has no tensor-parallel terms: tp must be 1")
        self.model, self.device, self.tp = model, device, tp
        self.paged, self.block_size = paged, block_size
        self.term_scale = dict(term_scale or {})
        eff = device.efficiency
        self._flops = device.matmul_flops * eff.matmul
        self._attn_flops = device.matmul_flops * eff.attention
        self._bw = device.memory_bandwidth * eff.memory
        self._attn_bw = device.memory_bandwidth * eff.attention_memory

    def step_time(self, work: StepWork) -> StepTime:
        if work.num_tokens == 0:
            return StepTime(0, 0, 0, 0, 0, 0, 0, 0)
        t = self._measured(work) if self.device.calibration is not None else self._roofline(work)
        if not self.term_scale:
            return t
        return StepTime(**{k: getattr(t, k) * self.term_scale.get(k, 1.0) for k in TERMS})

    # ---- the local preset: measured terms --------------------------------------------------------------
    def _measured(self, w: StepWork) -> StepTime:
        c, m = self.device.calibration, self.model
        L = m.num_layers
        loop = c.loop_factor(w.num_tokens)     # the validated layer loop against the one the terms were fitted in
        linear = loop * (L * sum(c.linear_time(n, k, w.num_tokens) for n, k in m.attention_matrices)
                         + m.dense_layers * sum(c.linear_time(n, k, w.num_tokens) for n, k in m.mlp_matrices))
        if m.sparse_layers:      # the experts the step's tokens route to, each over its share of the rows
            experts = m.experts_read(w.num_tokens)
            rows = max(1, round(w.num_tokens * m.experts_per_token / experts))
            linear += loop * m.sparse_layers * experts * sum(c.linear_time(n, k, rows) for n, k in m.expert_matrices)
        lm_head = interpolate(c.lm_head, w.num_sampled) if w.num_sampled else 0.0
        d = c.decode_coefficients(self.block_size if self.paged else None)
        decode = L * (d[0] + d[1] * w.num_decodes + d[2] * w.decode_pairs) if w.num_decodes else 0.0
        p = c.prefill_attention
        prefill = L * (p[0] + p[1] * w.num_prefills + p[2] * w.prefill_pairs) if w.num_prefills else 0.0
        elementwise = loop * L * c.elementwise_time(w.num_tokens)
        sampling = c.sampling_time(w.num_sampled) if w.num_sampled else 0.0
        o = c.step
        overhead = o[0] + o[1] * w.num_seqs + (o[2] * w.num_tokens if len(o) > 2 else 0.0)
        return StepTime(linear, lm_head, prefill, decode, elementwise, sampling, 0.0, overhead)

    # ---- GPU presets: a roofline per term -------------------------------------------------------------
    def _roof(self, flops: float, nbytes: float, rate: float, bandwidth: float) -> float:
        return max(flops / rate, nbytes / bandwidth)

    def _roofline(self, w: StepWork) -> StepTime:
        m, tp, eff = self.model, self.tp, self.device.efficiency
        L, b = m.num_layers, m.dtype_bytes
        linear = sum(self._roof(2 * layers * n * k * w.num_tokens / tp, layers * n * k * b / tp, self._flops, self._bw)
                     for layers, matrices in ((L, m.attention_matrices), (m.dense_layers, m.mlp_matrices))
                     for n, k in matrices)
        if m.sparse_layers:      # k experts' work per token; the bytes of the experts the tokens route to
            expert = sum(n * k for n, k in m.expert_matrices)
            linear += self._roof(2 * m.sparse_layers * m.experts_per_token * expert * w.num_tokens / tp,
                                 m.sparse_layers * m.experts_read(w.num_tokens) * expert * b / tp, self._flops, self._bw)
        lm_head = self._roof(2 * m.head_params * w.num_sampled / tp, m.head_params * b / tp, self._flops,
                             self._bw) if w.num_sampled else 0.0
        per_pair = 4 * m.num_heads * m.head_dim * L / tp            # QK^T and PV, all layers
        kv_bytes = m.kv_bytes_per_token / tp                        # K and V of one token, all layers
        prefill = self._roof(per_pair * w.prefill_pairs, kv_bytes * w.prefill_kv_tokens, self._attn_flops,
                             self._attn_bw)
        decode = self._roof(per_pair * w.decode_pairs, kv_bytes * w.decode_pairs, self._attn_flops, self._attn_bw)
        if self.paged:
            decode *= eff.paged_attention_penalty
        # Element-wise kernels stream the activations: two add-RMSNorms (x, y in; x, out), RoPE
        # (Q, K in and out), SiLU-and-mul (gate, up in; out), the KV write (K, V in; the cache out).
        h, q, kv, f = m.hidden_size, m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim, m.ffn_size
        per_token = (8 * h + 2 * (q + kv) + 3 * f + 4 * kv) * b / tp
        elementwise = L * per_token * w.num_tokens / self._bw
        # Sampling: the float32 logits read about three times (softmax, argmax or the draw).
        sampling = 3 * 4 * m.vocab_size * w.num_sampled / self._bw
        allreduce = 0.0
        if tp > 1:
            message = w.num_tokens * m.hidden_size * b
            ring = 2 * (tp - 1) / tp * message / (self.device.link_bandwidth * eff.allreduce)
            allreduce = 2 * L * (ring + eff.allreduce_latency_s)
        overhead = eff.step_overhead_s + eff.per_seq_overhead_s * w.num_seqs
        return StepTime(linear, lm_head, prefill, decode, elementwise, sampling, allreduce, overhead)

    def kv_cache_tokens(self, gpu_memory_utilization: float = 0.9) -> int:
        """KV slots left on `tp` GPUs after the weights, at this share of their memory (the
        paper's Table 1: 15.7k for OPT-13B on an A100-40GB)."""
        free = self.tp * self.device.memory_bytes * gpu_memory_utilization - self.model.weight_bytes
        if free <= 0:
            raise ValueError(f"{self.model.name} ({self.model.weight_bytes / 1e9:.0f} GB of weights) does not fit "
                             f"on {self.tp} x {self.device.name}")
        return int(free // self.model.kv_bytes_per_token)
