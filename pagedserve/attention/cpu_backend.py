"""The CPU attention backend: decodes run a compiled paged-attention kernel that reads
keys and values in place from their blocks; prefill chunks use torch's SDPA.

The kernel (cpu_kernels.cpp) is compiled once with the system C++ compiler for this
machine (-march=native) and cached under ~/.cache/pagedserve/kernels; it is loaded with
ctypes, so no torch headers or build step at install time. Without a compiler the
backend falls back to the torch reference path, with a warning.
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

from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.config import cache_dir
from pagedserve.attention.torch_backend import TorchAttention

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
PARTITION_SIZE = 256      # context tokens per work item: parallelism for long sequences

_lib: ctypes.CDLL | None = None
_load_failed = False


def _cpu_signature() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = ""
    return platform.machine() + flags


def load_kernels() -> ctypes.CDLL | None:
    """Compile (once per source/CPU) and load the kernel library; None if impossible."""
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
            with tempfile.TemporaryDirectory(dir=path.parent) as tmp:   # atomic: other processes may race
                tmp_so = Path(tmp) / path.name
                subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(tmp_so)], check=True,
                               capture_output=True, text=True)
                os.replace(tmp_so, path)
        lib = ctypes.CDLL(str(path))
        for name in ("paged_decode_f32", "paged_decode_bf16"):
            fn = getattr(lib, name)
            fn.restype = ctypes.c_int
            fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p] + \
                [ctypes.c_int64] * 5 + [ctypes.c_float, ctypes.c_int64]
        _lib = lib
    except (OSError, RuntimeError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        logger.warning("CPU attention kernel unavailable, using the slower torch path: %s", detail[-2000:])
        _load_failed = True
    return _lib


class CpuAttention(TorchAttention):
    name = "cpu"

    def __init__(self) -> None:
        self.lib = load_kernels()

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        fn = None
        if self.lib is not None:
            fn = {torch.float32: self.lib.paged_decode_f32, torch.bfloat16: self.lib.paged_decode_bf16}.get(q.dtype)
        if fn is None:
            return super()._decode(q, kv_cache, meta, scale)
        nd, num_heads, head_dim = q.shape
        _, _, block_size, num_kv_heads, _ = kv_cache.shape
        q = q.contiguous()
        out = torch.empty_like(q)
        tables = meta.block_tables
        status = fn(q.data_ptr(), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(), tables.data_ptr(),
                    tables.stride(0), meta.seq_lens.data_ptr(), out.data_ptr(), nd, num_heads, num_kv_heads,
                    head_dim, block_size, scale, PARTITION_SIZE)
        if status != 0:
            return super()._decode(q, kv_cache, meta, scale)
        return out
