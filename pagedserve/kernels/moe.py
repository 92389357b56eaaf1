"""A mixture-of-experts layer's routed experts in one C++ call (quant_kernels' quant_moe_experts,
csrc/moe/experts.h): the step's tokens grouped by expert, each chosen expert's gate, up and down
read once for all of its tokens (integer dots over 8-bit activations, the r8 layouts' 8-row
kernels where the loader repacked them), the gated activation between (SwiGLU, or gpt-oss's
clamped SwiGLU with its alpha and limit), the weighted sum per token in float32; experts no token
chose are never touched. One parallel region per layer, no Python per expert.

It takes experts whose weights are all quantized (a GGUF file's stacked experts: gate and up
apart; or one fused [2 I, H] gate_up), with or without biases (gpt-oss's), rows a multiple of 8;
in the avx512vnni build only in r8 layouts (quant.repack's `experts` makes them there: the same
256-bit r8 kernels, with its EVEX vpdpbusd); anything else (float experts) returns None and
models/moe.py runs the experts one by one through ops.linear.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from pagedserve.kernels import cpu, quant
from pagedserve.kernels.quant import QuantPart, QuantizedWeight, c_part


class MoEExpert(ctypes.Structure):
    """MoEExpert in csrc/moe/experts.h: one expert's gate [I, H], up [I, H], down [H, I] and their
    float32 biases (addresses, 0: none)."""
    _fields_ = [("gate", QuantPart), ("up", QuantPart), ("down", QuantPart), ("gate_bias", ctypes.c_void_p),
                ("up_bias", ctypes.c_void_p), ("down_bias", ctypes.c_void_p)]


class MoEGlu(ctypes.Structure):
    """MoEGlu in csrc/moe/experts.h: the gated activation (0 SwiGLU, 1 clamped SwiGLU) and its alpha, limit."""
    _fields_ = [("kind", ctypes.c_int64), ("alpha", ctypes.c_float), ("limit", ctypes.c_float)]


UNSUPPORTED = 2        # quant_moe_experts' status where its build does not run it
BUILDS = cpu._MOE_BUILDS       # the quant variants whose quant_moe_experts runs
# Of them, those that take experts in r8 layouts only (csrc/moe/experts.h): the builds where quant.repack
# makes r8 layouts for experts alone.
R8_ONLY = tuple(v for v in quant.EXPERT_R8_VARIANTS if v not in quant.R8_VARIANTS)
SCORINGS = {"softmax": 0, "topk_softmax": 1}          # models/moe.py's scorings as the compiled loop's MoE block codes them
GLUS = {"silu": 0, "clamped_swiglu": 1}               # models/moe.py's activations as the kernel codes them


def glu_of(spec) -> tuple[int, float, float]:
    """A MoESpec's activation as the kernel's (kind, alpha, limit)."""
    return GLUS[spec.activation], spec.swiglu_alpha, spec.swiglu_limit


def runs_here() -> bool:
    """Whether the active quant library runs the kernel (the compiled layer loop asks, per step)."""
    return quant.variant() in BUILDS


def _half(w: QuantizedWeight, second: bool) -> QuantPart:
    """Rows [0, n / 2) or [n / 2, n) of a fused gate_up (an r8 layout's data holds a group of 8 rows per row)."""
    part = c_part(w)
    rows = w.shape[0] // 2
    data_rows = rows // 8 if w.qtype in quant.R8 else rows
    return QuantPart(part.qtype, part.w + (part.ldw * data_rows if second else 0), part.ldw, rows)


def _fits(w: QuantizedWeight, rows: int, cols: int) -> bool:
    return w.shape == (rows, cols) and rows % 8 == 0 and cols % quant.BLOCK[w.qtype] == 0 and w.qtype != "q4_0x8" and \
        (w.qtype in quant.R8 or quant.variant() not in R8_ONLY)


@dataclass
class ExpertTable:
    """A layer's experts as the kernel takes them: the MoEExpert array (their weights' and biases'
    addresses), the experts themselves and the float32 biases, which it keeps alive."""
    array: ctypes.Array
    experts: list
    intermediate: int
    biases: list


def _bias(b: torch.Tensor | None, size: int) -> torch.Tensor | None:
    return None if b is None else b.detach().float().contiguous().view(size)


def expert_table(experts: list) -> ExpertTable | None:
    """The experts as the kernel's table, or None where one is not what the kernel takes."""
    if not experts or not isinstance(experts[0].down, QuantizedWeight):
        return None
    hidden, intermediate = experts[0].down.shape
    table = (MoEExpert * len(experts))()
    biases = []
    for slot, e in zip(table, experts):
        if not isinstance(e.down, QuantizedWeight) or \
                (e.gate_up_bias is not None and e.gate_up_bias.numel() != 2 * intermediate) or \
                (e.down_bias is not None and e.down_bias.numel() != hidden):
            return None
        gu = e.gate_up
        if isinstance(gu, tuple) and len(gu) == 2 and all(isinstance(p, QuantizedWeight) for p in gu):
            if not (_fits(gu[0], intermediate, hidden) and _fits(gu[1], intermediate, hidden)):
                return None
            gate, up = c_part(gu[0]), c_part(gu[1])
        elif isinstance(gu, QuantizedWeight) and _fits(gu, 2 * intermediate, hidden) and intermediate % 8 == 0:
            gate, up = _half(gu, False), _half(gu, True)
        else:
            return None
        if not _fits(e.down, hidden, intermediate):
            return None
        slot.gate, slot.up, slot.down = gate, up, c_part(e.down)
        gu_bias, down_bias = _bias(e.gate_up_bias, 2 * intermediate), _bias(e.down_bias, hidden)
        if gu_bias is not None:
            slot.gate_bias, slot.up_bias = gu_bias.data_ptr(), gu_bias.data_ptr() + 4 * intermediate
        if down_bias is not None:
            slot.down_bias = down_bias.data_ptr()
        biases += [gu_bias, down_bias]
    return ExpertTable(table, list(experts), intermediate, biases)


def routed_experts(h: torch.Tensor, table: ExpertTable, weights: torch.Tensor, ids: torch.Tensor,
                   glu: tuple[int, float, float] = (0, 1.0, 0.0), lib=None) -> torch.Tensor | None:
    """sum_s weights[t, s] * expert_{ids[t, s]}(h[t]) for each row t of h [T, H] (float32 [T, H]),
    or None where the kernel does not run here (no library, h not float32 / bf16, experts not in r8
    layouts in the avx512vnni build).
    glu: the activation (glu_of: SwiGLU by default); lib: another build of quant_kernels (a benchmark's A/B)."""
    lib = lib or quant.load()
    if lib is None or h.dtype not in (torch.float32, torch.bfloat16) or h.dim() != 2:
        return None
    num_tokens, hidden = h.shape
    h = h if h.stride(1) == 1 else h.contiguous()
    ids = ids.to(torch.int64).contiguous()
    weights = weights.to(torch.float32).contiguous()
    out = torch.zeros(num_tokens, hidden, dtype=torch.float32)
    act = MoEGlu(*glu)
    status = lib.quant_moe_experts(ctypes.addressof(table.array), len(table.array), h.data_ptr(), h.stride(0),
                                   int(h.dtype == torch.bfloat16), num_tokens, hidden, table.intermediate, ids.data_ptr(),
                                   weights.data_ptr(), ids.shape[1], ctypes.addressof(act),
                                   out.data_ptr())
    if status == UNSUPPORTED:
        return None
    if status:
        raise RuntimeError(f"quant_moe_experts failed (status {status})")
    return out


@dataclass
class LayerTable:
    """A mixture-of-experts layer as the compiled loop's MoE block takes it: its router float32
    [E, H], the router's bias float32 [E] (gpt-oss) or None, and its experts' table."""
    router: torch.Tensor
    router_bias: torch.Tensor | None
    table: ExpertTable


def layer_table(layer) -> LayerTable | None:
    """A mixture-of-experts layer's LayerTable for the compiled layer loop's MoE block
    (csrc/layers/moe_block.h: experts all quantized, no shared expert); None for a dense layer or
    a block it does not run."""
    w = layer.moe
    if w is None or w.shared is not None:
        return None
    table = expert_table(w.experts)
    bias = None if w.router_bias is None else w.router_bias.float().contiguous()
    return None if table is None else LayerTable(w.router.float().contiguous(), bias, table)
