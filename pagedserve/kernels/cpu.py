"""Hand-written CPU kernels (cpu_kernels.cpp), compiled once per machine, called via ctypes.

The source is compiled with the system C++ compiler for this CPU (-march=native) on first
use and cached under ~/.cache/pagedserve/kernels; no torch headers and no build step at
install time. Where it cannot be built, callers fall back to plain torch (with a warning).
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from pagedserve.config import cache_dir

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
PARTITION_SIZE = 256      # context tokens per decode-attention work item
SMALL_LINEAR_ROWS = 8     # up to this many rows, bf16 linears use the streaming kernel

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "paged_decode_f32": [_P] * 4 + [_I, _P, _P] + [_I] * 5 + [_F, _I],
    "paged_decode_bf16": [_P] * 4 + [_I, _P, _P] + [_I] * 5 + [_F, _I],
    "linear_bf16_small": [_P] * 4 + [_I] * 3,
}

_lib: ctypes.CDLL | None = None
_load_failed = False


def _cpu_signature() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = ""
    return platform.machine() + flags


def load() -> ctypes.CDLL | None:
    """Compile (once per source and CPU) and load the library; None if impossible."""
    global _lib, _load_failed
    if _lib is not None or _load_failed:
        return _lib
    try:
        key = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode() + _cpu_signature().encode())
        path = cache_dir("kernels") / f"cpu_kernels-{key.hexdigest()[:16]}.so"
        if not path.exists():
            compiler = shutil.which("g++") or shutil.which("c++")
            if compiler is None:
                raise RuntimeError("no C++ compiler (g++) found")
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=path.parent) as tmp:   # atomic: processes may race
                tmp_so = Path(tmp) / path.name
                subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(tmp_so)], check=True,
                               capture_output=True, text=True)
                os.replace(tmp_so, path)
        lib = ctypes.CDLL(str(path))
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.restype = ctypes.c_int
            fn.argtypes = argtypes
        _lib = lib
    except (OSError, RuntimeError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        logger.warning("CPU kernels unavailable, using slower torch paths: %s", detail[-2000:])
        _load_failed = True
    return _lib


def paged_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float) -> torch.Tensor | None:
    """q: [N, Hq, D]; kv_cache: [2, blocks, block_size, Hkv, D]; block_tables: [>=N, stride]
    int64; seq_lens: [>=N] int64. None where the kernel does not apply."""
    lib = load()
    fn = None if lib is None else {torch.float32: lib.paged_decode_f32,
                                   torch.bfloat16: lib.paged_decode_bf16}.get(q.dtype)
    if fn is None or not q.is_cpu:
        return None
    n, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    q = q.contiguous()
    out = torch.empty_like(q)
    status = fn(q.data_ptr(), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(), block_tables.data_ptr(),
                block_tables.stride(0), seq_lens.data_ptr(), out.data_ptr(), n, num_heads, num_kv_heads,
                head_dim, block_size, scale, PARTITION_SIZE)
    return out if status == 0 else None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, with bf16 products of a few rows streamed through the AVX512-BF16 kernel
    (torch's bf16 GEMV reads weights well below memory bandwidth)."""
    if x.dtype == torch.bfloat16 and x.shape[0] <= SMALL_LINEAR_ROWS and x.is_cpu and x.dim() == 2:
        lib = load()
        if lib is not None:
            x = x.contiguous()
            out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype)
            if lib.linear_bf16_small(x.data_ptr(), weight.data_ptr(), 0 if bias is None else bias.data_ptr(),
                                     out.data_ptr(), x.shape[0], weight.shape[0], x.shape[1]) == 0:
                return out
    return F.linear(x, weight, bias)
