"""Step time from what a step computes: a roofline per operation class.

Per step, each class of work takes the longer of its FLOPs at the device's (efficiency-scaled)
compute rate and its bytes at the (efficiency-scaled) memory bandwidth:
- linear layers: every weight is read once per step; 2 FLOPs per weight per token;
- the LM head: its weights once, 2 FLOPs per weight per sampled token;
- attention, prefill and decode apart (separate kernels): each sequence reads its context's
  K and V once per layer; 4 FLOPs per head dimension per (query, key) pair;
- tensor parallelism over `tp` GPUs: weights, FLOPs and KV split `tp` ways, plus two ring
  all-reduces of the step's activations per layer over NVLink;
- a fixed overhead per step.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pagedserve.sim.devices import Device
from pagedserve.sim.shapes import ModelShape


@dataclass(frozen=True)
class StepWork:
    """What one step computes, from the scheduler's output: per sequence, its start position
    and how many tokens it computes; and how many sequences sample."""
    num_tokens: int = 0             # new tokens, all sequences
    num_sampled: int = 0
    prefill_pairs: float = 0.0      # (query, key) pairs of multi-token chunks (causal)
    prefill_kv_tokens: int = 0      # context tokens those chunks read
    decode_pairs: int = 0           # single-token sequences: their contexts
    num_seqs: int = 0

    @classmethod
    def of(cls, seqs: Iterable[tuple[int, int]], num_sampled: int) -> "StepWork":
        """seqs: (start, num_new_tokens) of each scheduled sequence."""
        tokens = seqs_n = decode = prefill_kv = 0
        prefill = 0.0
        for start, n in seqs:
            tokens += n
            seqs_n += 1
            end = start + n
            if n == 1:
                decode += end
            else:
                prefill += n * start + n * (n + 1) / 2    # query i attends to start + i + 1 keys
                prefill_kv += end
        return cls(tokens, num_sampled, prefill, prefill_kv, decode, seqs_n)


@dataclass(frozen=True)
class StepTime:
    linear: float
    lm_head: float
    prefill_attention: float
    decode_attention: float
    allreduce: float
    overhead: float

    @property
    def total(self) -> float:
        return (self.linear + self.lm_head + self.prefill_attention + self.decode_attention + self.allreduce
                + self.overhead)


class CostModel:
    def __init__(self, model: ModelShape, device: Device, tp: int = 1) -> None:
        if tp < 1:
            raise ValueError(f"tp must be >= 1, got {tp}")
        self.model, self.device, self.tp = model, device, tp
        eff = device.efficiency
        self._flops = device.matmul_flops * eff.matmul
        self._attn_flops = device.matmul_flops * eff.attention
        self._bw = device.memory_bandwidth * eff.memory

    def _roofline(self, flops: float, nbytes: float, rate: float) -> float:
        return max(flops / rate, nbytes / self._bw)

    def step_time(self, work: StepWork) -> StepTime:
        m, tp, eff = self.model, self.tp, self.device.efficiency
        if work.num_tokens == 0:
            return StepTime(0, 0, 0, 0, 0, 0)
        L, b = m.num_layers, m.dtype_bytes
        linear = self._roofline(2 * L * m.layer_params * work.num_tokens / tp, L * m.layer_params * b / tp,
                                self._flops)
        lm_head = self._roofline(2 * m.head_params * work.num_sampled / tp, m.head_params * b / tp, self._flops) \
            if work.num_sampled else 0.0
        per_pair = 4 * m.num_heads * m.head_dim * L / tp            # QK^T and PV, all layers
        kv_bytes = m.kv_bytes_per_token / tp                        # K and V of one token, all layers
        prefill = self._roofline(per_pair * work.prefill_pairs, kv_bytes * work.prefill_kv_tokens, self._attn_flops)
        decode = self._roofline(per_pair * work.decode_pairs, kv_bytes * work.decode_pairs, self._attn_flops)
        allreduce = 0.0
        if tp > 1:
            message = work.num_tokens * m.hidden_size * b
            ring = 2 * (tp - 1) / tp * message / (self.device.link_bandwidth * eff.allreduce)
            allreduce = 2 * L * (ring + eff.allreduce_latency_s)
        return StepTime(linear, lm_head, prefill, decode, allreduce, eff.step_overhead_s)

    def kv_cache_tokens(self, gpu_memory_utilization: float = 0.9) -> int:
        """KV slots left on `tp` GPUs after the weights, at this share of their memory (the
        paper's Table 1: 15.7k for OPT-13B on an A100-40GB)."""
        free = self.tp * self.device.memory_bytes * gpu_memory_utilization - self.model.weight_bytes
        if free <= 0:
            raise ValueError(f"{self.model.name} ({self.model.weight_bytes / 1e9:.0f} GB of weights) does not fit "
                             f"on {self.tp} x {self.device.name}")
        return int(free // self.model.kv_bytes_per_token)
