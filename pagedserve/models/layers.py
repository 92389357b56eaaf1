"""Building blocks of Llama-family models: rotary embeddings (the dense ops are in ops.py)."""
from __future__ import annotations

import math

import torch


def yarn_inv_freq(dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """YaRN's inverse frequencies, as transformers computes them (the float32 operations in its
    order): each frequency between the original one (extrapolation: wavelengths well inside the
    original context, more than beta_fast turns there) and the original divided by `factor`
    (interpolation: fewer than beta_slow turns), a linear ramp between the two bounds (truncated
    to whole dimensions where `truncate`). `scaling` has its factor and attention factor resolved
    (architectures.yarn)."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]

    def correction_dim(turns: float) -> float:
        return (dim * math.log(original / (turns * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(scaling["beta_fast"]), correction_dim(scaling["beta_slow"])
    if scaling["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001                    # (transformers' guard against a zero-width ramp)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp                      # the share of the original frequency
    return interpolation * (1 - keep) + extrapolation * keep


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies for RoPE: plain, `linear`, `llama3` or `yarn` scaled."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "freq_factors":      # a GGUF file's rope_freqs: each frequency's divisor (Llama 3's)
        factors = torch.tensor(scaling["factors"], dtype=torch.float32)
        if factors.shape != inv_freq.shape:
            raise ValueError(f"rope_freqs has {factors.numel()} factors; RoPE over {head_dim} dimensions "
                             f"needs {inv_freq.numel()}")
        return inv_freq / factors
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
    if rope_type == "yarn":
        return yarn_inv_freq(head_dim, theta, scaling)
    raise ValueError(f"unsupported RoPE scaling type {rope_type!r}; supported: default, linear, llama3, yarn, "
                     f"freq_factors (GGUF rope_freqs)")


class RotaryEmbedding:
    """cos/sin tables for every position, looked up by each token's position (no padding).

    LongRoPE (Phi-3, Phi-4-mini) has short and long frequency factors. transformers uses the
    short ones while a sequence is at most `original_max_position_embeddings` long, and when it
    grows past that recomputes the whole sequence (every cached key) with the long ones. A paged
    cache whose blocks outlive and are shared between sequences cannot re-rotate its keys, so,
    as llama.cpp does, the context the engine serves chooses once: `context_len` past the
    original length takes the long factors for every position, else the short ones. Tokens equal
    transformers' for every sequence within the original length (short) and, in a longer
    context, for every sequence past it (long).

    YaRN scales cos and sin by its attention factor (transformers' attention_scaling), which
    scales every attention logit by its square."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None,
                 dtype: torch.dtype, context_len: int | None = None) -> None:
        scale = 1.0
        if (scaling or {}).get("rope_type") == "longrope":
            long = (context_len or max_positions) > scaling["original_max_position_embeddings"]
            factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
            inv_freq = rope_inv_freq(head_dim, theta, None)
            if factors.shape != inv_freq.shape:
                raise ValueError(f"LongRoPE has {factors.numel()} factors; RoPE over {head_dim} dimensions needs "
                                 f"{inv_freq.numel()}")
            inv_freq = inv_freq / factors
            scale = scaling["attention_factor"]
        else:
            inv_freq = rope_inv_freq(head_dim, theta, scaling)
            if (scaling or {}).get("rope_type") == "yarn":
                scale = scaling["attention_factor"]
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * scale).to(dtype)
        self.sin = (emb.sin() * scale).to(dtype)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: [T, 1, D], looked up once per step and shared by all layers."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; rotate-half (GPT-NeoX) layout, the reference formula term for term."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin

