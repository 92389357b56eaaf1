"""Building blocks of Llama-family models: RMSNorm, rotary embeddings, gated MLP activation."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from pagedserve.kernels import cpu as cpu_kernels


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dim() == 2 and (normed := cpu_kernels.add_rms_norm(x, None, weight, eps)) is not None:
        return normed
    # Normalise in float32, cast back, then scale: the reference implementation's order.
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def add_rms_norm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream x plus a layer's output y, and its normalisation: (x + y, norm).
    On CPU one fused kernel that updates x in place."""
    normed = cpu_kernels.add_rms_norm(x, y, weight, eps)
    if normed is not None:
        return x, normed
    x = x + y
    return x, rms_norm(x, weight, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    out = cpu_kernels.silu_and_mul(gate_up)
    if out is not None:
        return out
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies for RoPE: plain, `linear` or `llama3` scaled."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported RoPE scaling type {rope_type!r}; supported: default, linear, llama3")


class RotaryEmbedding:
    """cos/sin tables for every position, looked up by each token's position (no padding)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None,
                 dtype: torch.dtype) -> None:
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(dtype)
        self.sin = emb.sin().to(dtype)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: [T, 1, D], looked up once per step and shared by all layers."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; rotate-half (GPT-NeoX) layout, the reference formula term for term."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def rotate_queries_and_keys(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                            cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D] and k [T, Hkv, D] of a fused qkv projection [T, (Hq + 2 Hkv) D], with RoPE
    applied: in place in qkv on CPU (one kernel), as a new tensor elsewhere."""
    num_tokens, heads = qkv.shape[0], num_heads + num_kv_heads
    qk = qkv[:, :heads * head_dim].view(num_tokens, heads, head_dim)
    if not cpu_kernels.rope_inplace(qkv, heads, head_dim, cos.view(num_tokens, head_dim),
                                    sin.view(num_tokens, head_dim)):
        qk = apply_rope(qk, cos, sin)
    return qk[:, :num_heads], qk[:, num_heads:]
