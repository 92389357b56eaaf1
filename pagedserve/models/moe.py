"""A mixture-of-experts block over a flat batch (Qwen3-MoE, Mixtral, OLMoE, gpt-oss, Qwen2-MoE's
shared expert): it takes the MLP's place in a decoder layer.

Per step: router logits in float32 (routing is a discrete choice: its precision decides which
weights are read), each token's top-k experts and their weights (`route`), then the tokens
grouped by expert: each chosen expert runs once over all of its tokens (its weights read once
per step), and an expert no token chose is never touched. The weighted outputs are summed in
float32 per token. Where the ops have a kernel for the whole set (`ops.routed_experts`: CpuOps
over quantized experts, SwiGLU or gpt-oss's clamped SwiGLU with biases, kernels/moe.py; TritonOps
over float experts on CUDA, kernels/triton_moe.py) it runs them in one call; else each expert runs
here through the same `linear` as every other projection (float, packed or quantized GGUF blocks).

An expert's weights are whatever the loader made: one [2 I, H] matrix (gate rows, then up
rows), or a (gate, up) tuple of quantized views into a GGUF file's 3-D tensors (one product,
no copy). `count_expert_reads` records which experts each block ran (tests, accounting).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

from pagedserve.models.quantized import Weight, weight_nbytes

# Scoring: "softmax" (softmax over all experts, then the top k; with norm_topk_prob the k
# weights renormalised to sum to 1: Qwen3-MoE, OLMoE, Mixtral, whose top-k-then-softmax is the
# same numbers), "topk_softmax" (the top k logits, then a softmax over those k: gpt-oss).
SCORINGS = ("softmax", "topk_softmax")
# Activations: "silu" (SwiGLU: silu(gate) * up), "clamped_swiglu" (gpt-oss: gate clamped above
# at limit, up to [-limit, limit], gate * sigmoid(alpha * gate) * (up + 1)).
ACTIVATIONS = ("silu", "clamped_swiglu")


@dataclass(frozen=True)
class MoESpec:
    """What a config says about its MoE layers."""
    num_experts: int
    top_k: int
    intermediate_size: int              # each expert's FFN width
    scoring: str = "softmax"
    norm_topk_prob: bool = False
    activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    shared_intermediate_size: int = 0   # a shared expert every token runs (0: none)
    decoder_sparse_step: int = 1        # every n-th layer is sparse (Qwen's decoder_sparse_step)
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.scoring not in SCORINGS:
            raise ValueError(f"MoE scoring {self.scoring!r}: one of {SCORINGS}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"MoE activation {self.activation!r}: one of {ACTIVATIONS}")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"MoE: num_experts_per_tok {self.top_k} must be in 1..num_experts ({self.num_experts})")
        if self.decoder_sparse_step < 1:
            raise ValueError(f"MoE: decoder_sparse_step {self.decoder_sparse_step} must be at least 1")

    def is_sparse(self, layer: int) -> bool:
        """Whether layer `layer` has the MoE block (else a dense MLP), as transformers decides."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


@dataclass
class ExpertWeights:
    """One expert's FFN (or a shared expert): gate_up [2 I, H] (gate rows, then up rows; a
    tuple (gate, up) of quantized parts is one product), down [H, I]; gpt-oss has biases."""
    gate_up: Weight
    down: Weight
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return sum(weight_nbytes(w) for w in (self.gate_up, self.down, self.gate_up_bias, self.down_bias)
                   if w is not None)


@dataclass
class MoEWeights:
    """A layer's MoE block: the router [E, H] (float32), its experts, an optional shared expert
    and the shared expert's sigmoid gate [1, H] (Qwen2-MoE)."""
    router: torch.Tensor
    experts: list[ExpertWeights]
    router_bias: torch.Tensor | None = None
    shared: ExpertWeights | None = None
    shared_gate: torch.Tensor | None = None
    layer: int = 0                      # for count_expert_reads

    def to(self, device: torch.device) -> None:
        """Float weights to `device`, in place (quantized experts stay: they run on the CPU only)."""
        def move(t):
            if isinstance(t, torch.Tensor):
                return t.to(device)
            if torch.device(device).type != "cpu":
                raise ValueError(f"quantized experts run on the CPU only, not on {device}")
            return t
        self.router, self.router_bias, self.shared_gate = (None if t is None else move(t) for t in
                                                           (self.router, self.router_bias, self.shared_gate))
        for e in self.experts + ([self.shared] if self.shared else []):
            e.gate_up, e.down = move(e.gate_up), move(e.down)
            e.gate_up_bias, e.down_bias = (None if t is None else move(t) for t in (e.gate_up_bias, e.down_bias))

    def expert_bytes(self) -> int:
        return sum(e.nbytes for e in self.experts)

    def active_bytes(self, top_k: int) -> int:
        """Bytes one token reads: the router, k experts (their average size) and the shared expert."""
        per_expert = self.expert_bytes() // max(len(self.experts), 1)
        shared = (self.shared.nbytes if self.shared else 0) + \
            (weight_nbytes(self.shared_gate) if self.shared_gate is not None else 0)
        return weight_nbytes(self.router) + top_k * per_expert + shared


def route(logits: torch.Tensor, spec: MoESpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's top-k experts: (weights [T, k] float32, expert ids [T, k] int64)."""
    logits = logits.float()
    if spec.scoring == "topk_softmax":
        top, ids = torch.topk(logits, spec.top_k, dim=-1)
        return torch.softmax(top, dim=-1), ids
    top, ids = torch.topk(torch.softmax(logits, dim=-1), spec.top_k, dim=-1)
    if spec.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return top, ids


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's activation of [T, 2 I] (gate columns, then up columns): [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return gate * torch.sigmoid(gate * alpha) * (up + 1)


Linear = Callable[..., torch.Tensor]     # ops.linear, or it with decode=True


def run_expert(x: torch.Tensor, expert: ExpertWeights, spec: MoESpec, ops, linear: Linear) -> torch.Tensor:
    """One expert's FFN over the rows x [n, H]: [n, H]."""
    gate_up = linear(x, expert.gate_up, expert.gate_up_bias)
    if spec.activation == "silu":
        act = ops.silu_and_mul(gate_up)
    else:
        act = clamped_swiglu(gate_up, spec.swiglu_alpha, spec.swiglu_limit)
    return linear(act, expert.down, expert.down_bias)


@dataclass
class ExpertReads:
    """What count_expert_reads saw: per block call, (layer, expert, rows) for each expert run."""
    calls: list[list[tuple[int, int, int]]] = field(default_factory=list)

    def experts(self, layer: int | None = None) -> set[int]:
        return {e for call in self.calls for (lay, e, _) in call if layer is None or lay == layer}


_reads: ExpertReads | None = None


@contextlib.contextmanager
def count_expert_reads() -> Iterator[ExpertReads]:
    """Record the experts every MoE block runs inside the block (not thread-safe: tests, tools)."""
    global _reads
    previous, _reads = _reads, ExpertReads()
    try:
        yield _reads
    finally:
        _reads = previous


def _quantized_parts(weight) -> list | None:
    """A weight's quantized parts (a QuantizedWeight, or a tuple of them), else None."""
    from pagedserve.quant_format import QuantizedWeight
    if isinstance(weight, QuantizedWeight):
        return [weight]
    if isinstance(weight, tuple) and all(isinstance(p, QuantizedWeight) for p in weight):
        return list(weight)
    return None


def _one_token(h: torch.Tensor, experts: list[ExpertWeights], weights: list[float], spec: MoESpec, ops,
               linear: Linear, out: torch.Tensor) -> None:
    """One token's k experts added into out [1, H]. Quantized experts' gate/up run as one product
    over all k experts' parts (one activation quantization, one parallel pass: k - 1 kernel calls
    fewer per layer); each down is its own (its input is its expert's)."""
    parts = [_quantized_parts(e.gate_up) for e in experts]
    if any(p is None for p in parts):
        for e, weight in zip(experts, weights):
            out.add_(run_expert(h, e, spec, ops, linear).float(), alpha=weight)
        return
    bias = None if experts[0].gate_up_bias is None else torch.cat([e.gate_up_bias for e in experts])
    gate_up = linear(h, tuple(p for ps in parts for p in ps), bias).view(len(experts), -1)   # [k, 2 I]
    if spec.activation == "silu":
        act = ops.silu_and_mul(gate_up)
    else:
        act = clamped_swiglu(gate_up, spec.swiglu_alpha, spec.swiglu_limit)
    for j, (e, weight) in enumerate(zip(experts, weights)):
        out.add_(linear(act[j:j + 1], e.down, e.down_bias).float(), alpha=weight)


def _experts_one_by_one(h: torch.Tensor, w: MoEWeights, spec: MoESpec, ops, linear: Linear, weights: torch.Tensor,
                        ids: torch.Tensor, ran: list) -> torch.Tensor:
    """The routed experts' weighted sum (float32 [T, H]), each chosen expert run here over its tokens."""
    num_tokens = h.shape[0]
    out = torch.zeros(num_tokens, h.shape[1], dtype=torch.float32, device=h.device)
    if num_tokens == 1:          # a single decode: its k experts, nothing to group
        chosen = ids[0].tolist()
        _one_token(h, [w.experts[e] for e in chosen], weights[0].tolist(), spec, ops, linear, out)
        ran.extend((w.layer, e, 1) for e in chosen)
        return out
    flat = ids.view(-1)
    order = torch.argsort(flat, stable=True)         # (token, slot) pairs grouped by expert
    tokens = order // spec.top_k
    gathered = weights.view(-1)[order]
    counts = torch.bincount(flat, minlength=spec.num_experts).tolist()
    start = 0
    for e, n in enumerate(counts):
        if not n:            # no token chose it: its weights are not read
            continue
        rows = tokens[start:start + n]
        y = run_expert(h.index_select(0, rows), w.experts[e], spec, ops, linear)
        out.index_add_(0, rows, y.float() * gathered[start:start + n, None])
        ran.append((w.layer, e, n))
        start += n
    return out


def moe_forward(h: torch.Tensor, w: MoEWeights, spec: MoESpec, ops, linear: Linear | None = None) -> torch.Tensor:
    """The block's output for the normalised hidden states h [T, H] (h's dtype)."""
    num_tokens = h.shape[0]
    if not num_tokens:
        return torch.zeros_like(h)
    logits = F.linear(h.float(), w.router, w.router_bias)
    weights, ids = route(logits, spec)
    ran: list[tuple[int, int, int]] = []
    # the ops' one call for every routed expert (grouped by expert there), where they have one
    out = ops.routed_experts(h, w.experts, weights, ids, spec)
    if out is None:
        out = _experts_one_by_one(h, w, spec, ops, linear or ops.linear, weights, ids, ran)
    elif _reads is not None:
        counts = torch.bincount(ids.view(-1), minlength=spec.num_experts).tolist()
        ran.extend((w.layer, e, n) for e, n in enumerate(counts) if n)
    if w.shared is not None:
        shared = run_expert(h, w.shared, spec, ops, linear or ops.linear).float()
        if w.shared_gate is not None:
            shared = shared * torch.sigmoid(F.linear(h.float(), w.shared_gate.float()))
        out += shared
    if _reads is not None:
        _reads.calls.append(ran)
    return out.to(h.dtype)
