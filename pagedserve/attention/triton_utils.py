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

LOG2E = 1.4426950408889634      # the kernels' softmax runs in base 2 (exp2)


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


def check_window(window: int | None) -> int:
    """A sliding window as the kernels take it: tokens, 0 for full attention."""
    if window is None:
        return 0
    if window < 1:
        raise ValueError(f"a sliding window must be at least 1 token, got {window}")
    return int(window)


def check_sinks(sinks: torch.Tensor | None, num_heads: int, device: torch.device) -> torch.Tensor | None:
    """Attention sinks as the kernels read them: one float32 logit per query head, on the device."""
    if sinks is None:
        return None
    if sinks.shape != (num_heads,):
        raise ValueError(f"attention sinks must be one logit per query head [{num_heads}], got {list(sinks.shape)}")
    return sinks.to(device=device, dtype=torch.float32).contiguous()


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(n)


def dot_precision(dtype: torch.dtype) -> str:
    """float32 tiles multiply in full precision, as the torch reference does (TF32 would
    round them); for bfloat16/float16 tiles the setting does not apply."""
    return "ieee" if dtype == torch.float32 else "tf32"


def upcast(kernel, dtype: torch.dtype) -> bool:
    return is_interpreted(kernel) and dtype != torch.float32


@triton.jit
def attend_tile(q, k, v, s_mask, m_i, l_i, acc, qk_scale, softcap2, PRECISION: tl.constexpr,
                SOFTCAP: tl.constexpr, MAYBE_EMPTY: tl.constexpr = False):
    """One step of the online softmax: the scores of the query rows q [M, D] against the
    key tile k [N, D] (where s_mask holds; `True` for a tile every row may see) are
    folded into the running max m_i, sum l_i (base 2) and output acc [M, D].

    SOFTCAP: scores capped as cap * tanh(s / cap) (Gemma 2); the scores here are in base 2
    (times log2 e), so softcap2 = cap * log2 e caps them the same. MAYBE_EMPTY: a row may have
    no visible key in this tile and none before (a sliding window's edge); it keeps its state
    (the max it subtracts is 0 then, never -inf - -inf)."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    if SOFTCAP:
        # tanh(x) = 1 - 2 / (exp(2x) + 1): saturates to +-1 without overflow.
        s = softcap2 * (1.0 - 2.0 / (tl.exp2(s * (2.8853900817779268 / softcap2)) + 1.0))
    s = tl.where(s_mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = m_new
    if MAYBE_EMPTY:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def sink_start(sinks_ptr, heads, h_mask, USE, M: tl.constexpr, HAS_SINKS: tl.constexpr):
    """The online softmax's starting max and sum for query rows of heads [M]: with attention
    sinks (gpt-oss: a learned logit per head, in the denominator only) the sink is a key of
    value 0 seen first (max = its logit in base 2, sum 1); else nothing seen (-inf, 0).
    USE false: a split-decode partition other than the first (the sink counts once)."""
    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + heads, mask=h_mask, other=0.0).to(tl.float32) * 1.4426950408889634
        m_i = tl.where(USE, sink, m_i)
        l_i = tl.where(USE, l_i + 1.0, l_i)
    return m_i, l_i


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
