"""Small helpers shared by the Triton kernels: interpreter or compiled, block shapes.

On CUDA tensors the kernels are compiled. Without a GPU they run under Triton's
interpreter (the kernels' Python source executed on numpy, one program at a time),
which Triton turns on for a whole process when TRITON_INTERPRET=1 is set before it
is first imported; the tests set it in conftest.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction


def is_interpreted(kernel) -> bool:
    """True when `kernel` runs under the interpreter. It has no bfloat16/float16
    arithmetic (numpy has no bfloat16), so kernels then upcast their tiles to float32."""
    return isinstance(kernel, InterpretedFunction)


def check_device(kernel, device: torch.device) -> None:
    """Compiled kernels need CUDA tensors; say so instead of failing inside Triton."""
    if device.type != "cuda" and not is_interpreted(kernel):
        raise ValueError(
            f"the Triton kernels need CUDA tensors, got tensors on {device}; to run them on CPU "
            "(slowly, for testing) set TRITON_INTERPRET=1 before Python first imports triton")


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(n)


def dot_precision(dtype: torch.dtype) -> str:
    """float32 tiles multiply in full precision, as the torch reference does (TF32 would
    round them); for bfloat16/float16 tiles the setting does not apply."""
    return "ieee" if dtype == torch.float32 else "tf32"


def upcast(kernel, dtype: torch.dtype) -> bool:
    return is_interpreted(kernel) and dtype != torch.float32


@triton.jit
def attend_tile(q, k, v, s_mask, m_i, l_i, acc, qk_scale, PRECISION: tl.constexpr):
    """One step of the online softmax: the scores of the query rows q [M, D] against the
    key tile k [N, D] (where s_mask holds; `True` for a tile every row may see) are
    folded into the running max m_i, sum l_i (base 2) and output acc [M, D]."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    s = tl.where(s_mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def load_kv_tile(k_cache_ptr, v_cache_ptr, table, n, n_mask, d, d_mask, kv_head,
                 stride_c_block, stride_c_tok, stride_c_head,
                 PAGE: tl.constexpr, MASKED: tl.constexpr, UPCAST: tl.constexpr):
    """K and V [N, D] of context tokens n [N] of one KV head, each token found through its
    sequence's block table (physical block table[n // PAGE], slot n % PAGE). MASKED=False
    for a tile known to lie wholly inside the context: no masks on the token axis."""
    if MASKED:
        block = tl.load(table + n // PAGE, mask=n_mask, other=0)
        mask = n_mask[:, None] & d_mask[None, :]
    else:
        block = tl.load(table + n // PAGE)
        mask = d_mask[None, :]
    # 64-bit offsets: a layer's cache can hold more than 2**31 elements.
    rows = block.to(tl.int64) * stride_c_block + (n % PAGE) * stride_c_tok + kv_head * stride_c_head
    k = tl.load(k_cache_ptr + rows[:, None] + d[None, :], mask=mask, other=0.0)
    v = tl.load(v_cache_ptr + rows[:, None] + d[None, :], mask=mask, other=0.0)
    if UPCAST:
        k, v = k.to(tl.float32), v.to(tl.float32)
    return k, v
