"""A mixture-of-experts layer's routed experts in one C++ call (quant_kernels' quant_moe_experts,
csrc/moe/experts.h): the step's tokens grouped by expert, each chosen expert's gate, up and down
read once for all of its tokens (integer dots over 8-bit activations, the r8 layouts' 8-row
kernels where the loader repacked them), SiLU-and-mul between, the weighted sum per token in
float32; experts no token chose are never touched. One parallel region per layer, no Python per
expert.

It takes experts whose weights are all quantized (a GGUF file's stacked experts: gate and up
apart; or one fused [2 I, H] gate_up), SwiGLU without biases, rows a multiple of 8; anything else
(float experts, gpt-oss's clamped SwiGLU with biases, the AVX-512 build) returns None and
models/moe.py runs the experts one by one through ops.linear.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from pagedserve.kernels import cpu, quant
from pagedserve.kernels.quant import QuantPart, QuantizedWeight, c_part


class MoEExpert(ctypes.Structure):
    """MoEExpert in csrc/moe/experts.h: one expert's gate [I, H], up [I, H], down [H, I]."""
    _fields_ = [("gate", QuantPart), ("up", QuantPart), ("down", QuantPart)]


UNSUPPORTED = 2        # quant_moe_experts' status where its build does not run it
BUILDS = cpu._MOE_BUILDS       # the quant variants whose quant_moe_experts runs


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
    return w.shape == (rows, cols) and rows % 8 == 0 and cols % quant.BLOCK[w.qtype] == 0 and w.qtype != "q4_0x8"


@dataclass
class ExpertTable:
    """A layer's experts as the kernel takes them: the MoEExpert array (their weights' addresses)
    and the experts themselves, which it keeps alive."""
    array: ctypes.Array
    experts: list
    intermediate: int


def expert_table(experts: list) -> ExpertTable | None:
    """The experts as the kernel's table, or None where one is not what the kernel takes."""
    if not experts or not isinstance(experts[0].down, QuantizedWeight):
        return None
    hidden, intermediate = experts[0].down.shape
    table = (MoEExpert * len(experts))()
    for slot, e in zip(table, experts):
        if e.gate_up_bias is not None or e.down_bias is not None or not isinstance(e.down, QuantizedWeight):
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
    return ExpertTable(table, list(experts), intermediate)


def routed_experts(h: torch.Tensor, table: ExpertTable, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor | None:
    """sum_s weights[t, s] * expert_{ids[t, s]}(h[t]) for each row t of h [T, H] (float32 [T, H]),
    or None where the kernel does not run here (no library, the AVX-512 build, h not float32 / bf16)."""
    lib = quant.load()
    if lib is None or h.dtype not in (torch.float32, torch.bfloat16) or h.dim() != 2:
        return None
    num_tokens, hidden = h.shape
    h = h if h.stride(1) == 1 else h.contiguous()
    ids = ids.to(torch.int64).contiguous()
    weights = weights.to(torch.float32).contiguous()
    out = torch.zeros(num_tokens, hidden, dtype=torch.float32)
    status = lib.quant_moe_experts(ctypes.addressof(table.array), len(table.array), h.data_ptr(), h.stride(0),
                                   int(h.dtype == torch.bfloat16), num_tokens, hidden, table.intermediate, ids.data_ptr(),
                                   weights.data_ptr(), ids.shape[1], out.data_ptr())
    if status == UNSUPPORTED:
        return None
    if status:
        raise RuntimeError(f"quant_moe_experts failed (status {status})")
    return out


def layer_table(layer) -> tuple[torch.Tensor, ExpertTable] | None:
    """A mixture-of-experts layer's (router float32 [E, H], its ExpertTable) for the compiled layer
    loop's MoE block (csrc/layers/moe_block.h: SwiGLU experts all quantized, no shared expert, no
    router bias); None for a dense layer or a block it does not run."""
    w = layer.moe
    if w is None or w.shared is not None or w.router_bias is not None:
        return None
    table = expert_table(w.experts)
    return None if table is None else (w.router.float().contiguous(), table)
