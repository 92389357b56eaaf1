"""The float oracles of quantized models with the native integer path's 8-bit activations: on the
256-bit variants every product whose weights are all in r8 layouts with the integer GEMM (quant.R8_GEMM)
runs on the integer path at any row count, prefill chunks included (quant.batch_rows), so it computes
x8 @ W.T with x8 the activations as their q8 blocks hold them (quant.quantize_activations: per 32
elements, or 256 for the super-block layouts SUPER_ACT, d = max|x| / 127, q = round(x / d)). So do the routed experts (csrc/moe/experts.h: the
token's row, then the SwiGLU output, as 8-bit rows). The oracle's matching modules then see x8 as the
input of each of their products (torch.nn.functional.linear, which nn.Linear and transformers'
experts call, wrapped while their forward runs), so the two differ by float32 summation order, not by
the 8-bit rounding. On the INVARIANT_DOTS variants (avx512vnni) a batch-invariant step (the greedy
requests the oracle tests send) runs every quantized product on the integer dots at any row count.
Products elsewhere (other layouts, other variants: the float tiles in a prefill) keep the oracle's
float input."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import torch

from pagedserve.kernels import quant

# Our fused projections -> transformers' Linear modules under model.layers.{i}, in our parts' order
_HF_NAMES = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o": ("self_attn.o_proj",),
             "gate_up": ("mlp.gate_proj", "mlp.up_proj"), "down": ("mlp.down_proj",)}


def q8(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """x (any leading dims, last a multiple of `block`) as its 8-bit blocks hold it, in x's dtype."""
    return quant.q8_activations(x.reshape(-1, x.shape[-1]), block).view(x.shape).to(x.dtype)


def integer_path_modules(model) -> dict[str, int]:
    """The transformers names of the modules whose products our loaded `model` runs on the integer
    path in every step (r8 layouts with the GEMM, on the R8_VARIANTS; none elsewhere), each with
    its activations' block (32, or 256 for SUPER_ACT)."""
    every = quant.variant() in quant.INVARIANT_DOTS     # (greedy steps: batch-invariant, every product)
    if quant.variant() not in quant.R8_VARIANTS and not every:
        return {}
    names = {}
    for i, layer in enumerate(model.layers):
        for proj, hf in _HF_NAMES.items():
            w = getattr(layer, proj, None)
            if w is None:
                continue
            parts = w if isinstance(w, tuple) else (w,)
            integer = [isinstance(p, quant.QuantizedWeight) and (every or p.qtype in quant.R8_GEMM) for p in parts]
            if all(isinstance(p, quant.QuantizedWeight) for p in parts):     # one product (models/quantized.linear)
                integer = [all(integer)] * len(parts)
            if len(parts) == 1:
                integer, parts = integer * len(hf), parts * len(hf)
            assert len(integer) == len(hf), (proj, len(parts))
            names.update({f"model.layers.{i}.{n}": quant.activation_block(p.qtype) for n, p, on in zip(hf, parts, integer) if on})
        if getattr(layer, "moe", None) is not None:       # (the experts' gate_up and down: one block)
            gate_up = layer.moe.experts[0].gate_up
            names[f"model.layers.{i}.mlp.experts"] = quant.activation_block((gate_up[0] if isinstance(gate_up, tuple) else gate_up).qtype)
    if isinstance(model.lm_head, quant.QuantizedWeight) and (every or model.lm_head.qtype in quant.R8_GEMM):
        names["lm_head"] = quant.activation_block(model.lm_head.qtype)
    return names


@contextlib.contextmanager
def q8_inputs(hf: torch.nn.Module, names: dict[str, int]) -> Iterator[torch.nn.Module]:
    """A block in which the products of hf's modules `names` take their input as q8 in blocks of
    names[module] (then as before); raises at the end if one of them ran no product."""
    linear = torch.nn.functional.linear
    seen = {}

    def wrap(name: str, forward):
        def q8_forward(*args, **kwargs):
            def q8_linear(x, w, b=None):
                seen[name] = True
                return linear(q8(x, names[name]), w, b)
            with mock.patch("torch.nn.functional.linear", q8_linear):
                return forward(*args, **kwargs)
        return q8_forward

    modules = {n: hf.get_submodule(n) for n in names}
    # transformers' experts: their eager loop (F.linear per expert), not a grouped matmul
    configs = {id(m.config): (m.config, m.config._experts_implementation) for m in modules.values()
               if hasattr(m, "config") and hasattr(m.config, "_experts_implementation")}
    for n, m in modules.items():
        m.forward = wrap(n, m.forward)
    for config, _ in configs.values():
        config._experts_implementation = "eager"
    try:
        yield hf
    finally:
        for m in modules.values():
            del m.forward               # the class's forward again
        for config, before in configs.values():
            config._experts_implementation = before
    assert not modules or set(seen) == set(modules), sorted(set(modules) - set(seen))
