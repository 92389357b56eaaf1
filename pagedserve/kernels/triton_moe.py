"""A mixture-of-experts layer's routed experts on the GPU as a grouped GEMM in Triton.

One step's (token, slot) pairs are sorted by expert and each expert's run padded to a whole
number of BLOCK_M rows (`align_by_expert`, torch ops with shapes fixed by the token count: no
host sync, so a CUDA graph captures it). Then two launches over all experts at once:
- gate + up: program (block, column tile) multiplies one expert's BLOCK_M rows by BLOCK_N
  columns of its gate and the same columns of its up, adds their biases, applies the gated
  activation (SwiGLU, or gpt-oss's clamped SwiGLU with alpha and limit) and writes the rows'
  activations;
- down: program (block, column tile) multiplies those rows by its expert's down, adds the bias,
  scales each row by its routing weight and writes it to its pair's row.
The k rows of a token are then summed in float32 (a fixed order: no atomics). An expert no token
chose has no block, so no program reads its weights; the blocks the grid holds past the last used
one (the bound counts every expert's padding) exit at once.

The experts are float (bf16, fp16 or fp32) and stacked: gate_up [E, 2 I, H] (gate rows, then up
rows), down [E, H, I] (`stack_experts`, done once at load). Quantized experts never reach a GPU:
a GGUF file there is dequantized at load (models/quantized.py resolve_quantization) and gpt-oss's
MXFP4 experts too (models/moe_weights.py `keeps_mxfp4` is the CPU's); `stack_experts` returns
None for anything but float tensors, and the model then runs its experts one by one.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedserve.attention.triton_utils import check_device, dot_precision, upcast

GLUS = {"silu": 0, "clamped_swiglu": 1}      # models/moe.py's activations as the kernel codes them
NUM_WARPS = 4


@dataclass
class ExpertStack:
    """A layer's experts stacked for the grouped GEMM: gate_up [E, 2 I, H], down [E, H, I] and
    their biases [E, 2 I], [E, H] (or None); `experts` keeps the list it was made from."""
    gate_up: torch.Tensor
    down: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down_bias: torch.Tensor | None
    experts: list

    @property
    def intermediate(self) -> int:
        return self.down.shape[2]


def _stacked_bias(biases: list) -> torch.Tensor | None | bool:
    """The experts' biases [E, n], None where none has one, False where only some do."""
    if all(b is None for b in biases):
        return None
    if any(b is None for b in biases):
        return False
    return torch.stack([b.reshape(-1) for b in biases]).contiguous()


def stack_experts(experts: list) -> ExpertStack | None:
    """The experts (models/moe.py ExpertWeights) stacked for the grouped GEMM, or None where they
    are not all float matrices of one shape, dtype and device. Each expert's gate_up and down then
    become views of the stacks (its own tensors freed: the weights are held once)."""
    if not experts:
        return None
    first = experts[0]
    for e in experts:
        for w, like in ((e.gate_up, first.gate_up), (e.down, first.down)):
            if not isinstance(w, torch.Tensor) or not isinstance(like, torch.Tensor) or w.dim() != 2 or \
                    w.shape != like.shape or w.dtype != like.dtype or w.device != like.device:
                return None
    if first.gate_up.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return None
    two_inter, hidden = first.gate_up.shape
    if first.down.shape != (hidden, two_inter // 2) or two_inter % 2:
        return None
    gu_bias = _stacked_bias([e.gate_up_bias for e in experts])
    down_bias = _stacked_bias([e.down_bias for e in experts])
    if gu_bias is False or down_bias is False:
        return None
    gate_up = torch.stack([e.gate_up for e in experts]).contiguous()
    down = torch.stack([e.down for e in experts]).contiguous()
    for i, e in enumerate(experts):
        e.gate_up, e.down = gate_up[i], down[i]
    return ExpertStack(gate_up, down, gu_bias, down_bias, experts)


@dataclass
class ExpertBlocks:
    """A step's pairs grouped by expert for the kernels: `pairs` [num_blocks * block_m] int32, the
    pair index (token * k + slot) of each row, each expert's rows padded to whole blocks with
    num_pairs; `block_expert` [num_blocks] int32, each block's expert (-1: past the last used)."""
    pairs: torch.Tensor
    block_expert: torch.Tensor
    block_m: int


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The most blocks num_pairs pairs can fill: each chosen expert's rows rounded up to a whole
    block (at most min(E, pairs) experts are chosen)."""
    used = min(num_experts, num_pairs)
    return (num_pairs + used * (block_m - 1)) // block_m


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> ExpertBlocks:
    """ids [T, k]: each token's experts. Torch ops on ids' device, shapes fixed by T, k and E."""
    flat = ids.reshape(-1).to(torch.int64)
    n = flat.numel()
    device = flat.device
    order = torch.argsort(flat, stable=True)            # pair indices, by expert
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    run_start = torch.cumsum(counts, 0) - counts         # each expert's first row in `order`
    expert_of = flat[order]
    rows = padded_end[expert_of] - padded[expert_of] + torch.arange(n, device=device) - run_start[expert_of]
    num_blocks = max_blocks(n, num_experts, block_m)
    pairs = torch.full((num_blocks * block_m,), n, dtype=torch.int32, device=device)
    pairs[rows] = order.to(torch.int32)
    starts = torch.arange(num_blocks, device=device) * block_m
    block_expert = torch.searchsorted(padded_end, starts, right=True)   # E past the last used block
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    return ExpertBlocks(pairs, block_expert, block_m)


@triton.jit
def _gate_up_kernel(
    x_ptr, w_ptr, bias_ptr, pairs_ptr, block_expert_ptr, act_ptr,
    num_pairs, hidden, inter, alpha, limit,
    stride_xt, stride_we, stride_wn, stride_be, stride_at,
    TOP_K: tl.constexpr, GLU: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:                       # past the last used block: nothing to do
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pairs_ptr + rows)
    row_ok = pair < num_pairs            # an expert's padding rows read nothing
    token = (pair // TOP_K).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < inter
    w_gate = w_ptr + expert.to(tl.int64) * stride_we + n[None, :].to(tl.int64) * stride_wn    # [K, N] tiles
    w_up = w_gate + inter * stride_wn
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < hidden
        x = tl.load(x_ptr + token[:, None] * stride_xt + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & n_ok[None, :]
        gate = tl.load(w_gate + k[:, None], mask=w_mask, other=0.0)
        up = tl.load(w_up + k[:, None], mask=w_mask, other=0.0)
        if UPCAST:
            x, gate, up = x.to(tl.float32), gate.to(tl.float32), up.to(tl.float32)
        acc_gate = tl.dot(x, gate, acc_gate, input_precision=PRECISION)
        acc_up = tl.dot(x, up, acc_up, input_precision=PRECISION)
    if HAS_BIAS:
        b = bias_ptr + expert.to(tl.int64) * stride_be + n
        acc_gate += tl.load(b, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        acc_up += tl.load(b + inter, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if GLU == 0:        # SwiGLU: silu(gate) * up
        act = acc_gate * tl.sigmoid(acc_gate) * acc_up
    else:               # gpt-oss: gate clamped above at limit, up to [-limit, limit]
        g = tl.minimum(acc_gate, limit)
        u = tl.minimum(tl.maximum(acc_up, -limit), limit)
        act = g * tl.sigmoid(g * alpha) * (u + 1.0)
    out = act_ptr + rows[:, None].to(tl.int64) * stride_at + n[None, :]
    tl.store(out, act.to(act_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(
    act_ptr, w_ptr, bias_ptr, pairs_ptr, block_expert_ptr, route_ptr, out_ptr,
    num_pairs, hidden, inter,
    stride_at, stride_we, stride_wn, stride_be, stride_ot,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr, PRECISION: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pairs_ptr + rows)
    row_ok = pair < num_pairs
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < hidden
    w = w_ptr + expert.to(tl.int64) * stride_we + n[None, :].to(tl.int64) * stride_wn
    a_rows = act_ptr + rows[:, None].to(tl.int64) * stride_at
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < inter
        a = tl.load(a_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        d = tl.load(w + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if UPCAST:
            a, d = a.to(tl.float32), d.to(tl.float32)
        acc = tl.dot(a, d, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert.to(tl.int64) * stride_be + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    weight = tl.load(route_ptr + pair, mask=row_ok, other=0.0)
    acc = acc * weight[:, None]
    out = out_ptr + pair[:, None].to(tl.int64) * stride_ot + n[None, :]
    tl.store(out, acc, mask=row_ok[:, None] & n_ok[None, :])


@dataclass(frozen=True)
class Tiles:
    """Launch settings: rows per block (each expert's run is padded to it), column and reduction tiles."""
    block_m: int
    block_n: int = 64
    block_k: int = 64
    num_warps: int = NUM_WARPS


def choose_tiles(num_pairs: int, num_experts: int) -> Tiles:
    """16 rows a block while experts get a few rows each (decode: less padding read as zeros),
    64 once they get many (prefill: each weight tile serves more rows)."""
    per_expert = num_pairs / num_experts
    return Tiles(16 if per_expert <= 16 else 32 if per_expert <= 64 else 64)


def grouped_moe(h: torch.Tensor, stack: ExpertStack, weights: torch.Tensor, ids: torch.Tensor,
                activation: str = "silu", alpha: float = 1.702, limit: float = 7.0,
                tiles: Tiles | None = None) -> torch.Tensor:
    """sum_s weights[t, s] * expert_{ids[t, s]}(h[t]) for each row t of h [T, H]: float32 [T, H].
    activation: "silu" (SwiGLU) or "clamped_swiglu" (gpt-oss: alpha, limit)."""
    num_tokens, hidden = h.shape
    num_experts, two_inter, _ = stack.gate_up.shape
    inter = two_inter // 2
    top_k = ids.shape[1]
    num_pairs = num_tokens * top_k
    tiles = tiles or choose_tiles(num_pairs, num_experts)
    check_device(_gate_up_kernel, h.device)
    dtype = stack.gate_up.dtype
    x = h.to(dtype).contiguous()
    blocks = align_by_expert(ids, num_experts, tiles.block_m)
    num_blocks = blocks.block_expert.numel()
    act = torch.empty(num_blocks * tiles.block_m, inter, dtype=dtype, device=h.device)
    up_casting, precision = upcast(_gate_up_kernel, dtype), dot_precision(dtype)
    gu_bias = stack.gate_up_bias if stack.gate_up_bias is not None else act     # (unread without HAS_BIAS)
    _gate_up_kernel[(num_blocks, triton.cdiv(inter, tiles.block_n))](
        x, stack.gate_up, gu_bias, blocks.pairs, blocks.block_expert, act,
        num_pairs, hidden, inter, float(alpha), float(limit),
        x.stride(0), stack.gate_up.stride(0), stack.gate_up.stride(1), gu_bias.stride(0), act.stride(0),
        TOP_K=top_k, GLU=GLUS[activation], HAS_BIAS=stack.gate_up_bias is not None,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
        UPCAST=up_casting, PRECISION=precision, num_warps=tiles.num_warps)
    out = torch.empty(num_pairs, hidden, dtype=torch.float32, device=h.device)
    route = weights.to(torch.float32).reshape(-1).contiguous()
    d_bias = stack.down_bias if stack.down_bias is not None else out
    _down_kernel[(num_blocks, triton.cdiv(hidden, tiles.block_n))](
        act, stack.down, d_bias, blocks.pairs, blocks.block_expert, route, out,
        num_pairs, hidden, inter,
        act.stride(0), stack.down.stride(0), stack.down.stride(1), d_bias.stride(0), out.stride(0),
        HAS_BIAS=stack.down_bias is not None, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k, UPCAST=up_casting, PRECISION=precision, num_warps=tiles.num_warps)
    return out.view(num_tokens, top_k, hidden).sum(dim=1)
