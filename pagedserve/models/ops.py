"""The tensor operations a model runs, behind one object chosen once at load.

`ModelOps` is what models call for their dense math (linear layers, RMSNorm, RoPE,
SiLU-and-mul), for the arithmetic of quantized weights (quantize and repack at load, products,
embedding rows: pagedserve/quant_format.py's QuantizedWeight) and what the sampler calls for argmax. `TorchOps` is the device-agnostic
reference in plain torch; the CPU implementation (kernels/cpu_ops.py) calls the compiled
kernels. The worker picks one per device (worker/worker.py `make_ops`), so the model
itself never asks which device or kernels it runs on.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

from pagedserve.models import quantized
from pagedserve.models.layers import apply_rope
from pagedserve.quant_format import QuantizedWeight, quantize_torch

if TYPE_CHECKING:
    from pagedserve.attention.metadata import AttentionMetadata


class CompiledLayers(Protocol):
    """Every decoder layer of a model as one call (an ops implementation may offer it)."""

    def forward(self, x: torch.Tensor, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_caches: torch.Tensor, meta: AttentionMetadata, lora=None,
                local: tuple[torch.Tensor, torch.Tensor] | None = None) -> bool:
        """x (residual), h (first layer's normalised input) [T, H] updated in place to the final
        residual and normalised hidden state; cos, sin [T, D]; lora: a LoRAStep whose deltas
        it adds (lora/weights.py; passed only when there is one, or local is); local: the window
        layers' own cos, sin [T, D] (Gemma 3; passed only where the model has them). False
        (nothing done) where it does not apply."""


class ModelOps(Protocol):
    bf16_is_fast: bool          # dtype "auto" may keep a bf16 checkpoint in bf16

    def describe(self) -> str:
        """What the load log says about these ops (empty for plain torch)."""

    def prepare_weights(self, model) -> None:
        """Once, after the model moved to its device: repack weights for `linear`, and set
        `model.compiled_layers` where the whole layer loop runs as one call."""

    def linear(self, x: torch.Tensor, weight, bias: torch.Tensor | None = None, decode: bool = False,
               out_dtype: torch.dtype | None = None, invariant: bool = False) -> torch.Tensor:
        """x @ weight.T (+ bias); `decode`: x holds decode tokens only (quantized weights may then
        take their integer path for larger batches); out_dtype: the result's (default x's);
        `invariant`: a batch-invariant step (each row's arithmetic as if it were alone: quantized
        weights in r8 layouts keep their integer path for every row)."""

    def quantize(self, weight: torch.Tensor, qtype: str) -> QuantizedWeight:
        """A float matrix in q8_0 or q4_0 (the bytes of gguf.quants.quantize): quantize-at-load."""

    def repack(self, weight: QuantizedWeight, in_place: bool = False, mapped: bool = False,
               experts: bool = False) -> QuantizedWeight:
        """The weight in the layout these ops' kernels read fastest (or as it is); in_place: its
        bytes may be rewritten (the loader owns them); mapped: a small matrix left in the file's
        mapping, copied into that layout only where the kernels gain most from it; experts: a
        mixture-of-experts layer's expert (the layout its experts kernel reads)."""

    def quantized_linear(self, x: torch.Tensor, weight, bias: torch.Tensor | None = None, decode: bool = False,
                         out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x @ W.T (+ bias) for a QuantizedWeight or a tuple of them stacked by rows (one product)."""

    def invariance_changes(self, qtypes: set[str]) -> bool:
        """Whether a batch-invariant step (linear's `invariant`) computes products of weights of
        these block types (quantized.quantized_qtypes) with other arithmetic than a plain step."""

    def quantized_embedding(self, weight: QuantizedWeight, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` of a quantized table, dequantized ([*ids.shape, cols] in dtype)."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def add_rms_norm(self, x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream x plus a layer's output y, and its normalisation: (x + y, norm)."""

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...

    def routed_experts(self, h: torch.Tensor, experts: list, weights: torch.Tensor,
                       ids: torch.Tensor, spec) -> torch.Tensor | None:
        """A mixture-of-experts layer's routed experts in one call (models/moe.py; spec: its MoESpec,
        the activation): for each row t of h [T, H], sum_s weights[t, s] * expert_{ids[t, s]}(h[t]),
        float32 [T, H]; None where these ops have no such kernel for these experts (then moe.py runs
        them one by one)."""

    def rotate_queries_and_keys(self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                                cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D] and k [T, Hkv, D] of a fused qkv projection [T, (Hq + 2 Hkv) D], RoPE applied
        (cos, sin [T, 1, R]: to each head's leading R dimensions; R < D is partial rotary)."""

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """The index of each row's first maximum (a NaN counts as the maximum), as x.max(-1).indices."""


class TorchOps:
    """Plain torch, on any device: the reference the kernels are tested against."""
    bf16_is_fast = True

    def describe(self) -> str:
        return ""

    linear = staticmethod(quantized.linear)   # float weights: F.linear; quantized: quantized_linear
    # Quantized weights in plain torch: the reference of kernels/quant.py (dequantized exactly,
    # float32 products; no repacked layouts).
    quantize = staticmethod(quantize_torch)
    quantized_linear = staticmethod(quantized.linear_torch)
    quantized_embedding = staticmethod(quantized.embedding_rows_torch)

    @staticmethod
    def repack(weight: QuantizedWeight, in_place: bool = False, mapped: bool = False,
               experts: bool = False) -> QuantizedWeight:
        return weight

    @staticmethod
    def invariance_changes(qtypes: set[str]) -> bool:
        return False         # `invariant` changes nothing here

    def prepare_weights(self, model) -> None:
        pass

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # Normalise in float32, cast back, then scale: the reference implementation's order.
        return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)

    def add_rms_norm(self, x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        x = x + y
        return x, self.rms_norm(x, weight, eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def routed_experts(self, h: torch.Tensor, experts: list, weights: torch.Tensor,
                       ids: torch.Tensor, spec) -> torch.Tensor | None:
        return None          # moe.py's loop over the experts is the reference

    def rotate_queries_and_keys(self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                                cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        qk = qkv[:, :(num_heads + num_kv_heads) * head_dim].view(qkv.shape[0], num_heads + num_kv_heads, head_dim)
        rot = cos.shape[-1]
        if rot == head_dim:
            qk = apply_rope(qk, cos, sin)
        else:        # partial rotary: the leading `rot` dimensions of each head turn, the rest pass
            qk = torch.cat((apply_rope(qk[..., :rot], cos, sin), qk[..., rot:]), dim=-1)
        return qk[:, :num_heads], qk[:, num_heads:]

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        return x.max(dim=-1).indices
