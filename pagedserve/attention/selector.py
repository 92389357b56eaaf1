"""Pick the attention backend: cpu (compiled C++ decode kernel), torch (the reference),
or triton (GPU kernels)."""
from __future__ import annotations

import torch

from pagedserve.config import ATTENTION_BACKENDS as BACKENDS


def make_attention_backend(name: str | None, device: torch.device, kv_cache_dtype: str = "auto"):
    """None: triton on CUDA, cpu elsewhere. triton on a CPU runs Triton's interpreter
    (slow; for tests), which needs TRITON_INTERPRET=1 before triton is imported.
    kv_cache_dtype: an 8-bit KV cache (attention/kv_format.py) on the cpu and torch backends;
    refused on triton."""
    name = name or ("triton" if device.type == "cuda" else "cpu")
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError(f"attention_backend='cpu' runs on the CPU, not on {device}; use 'triton' or 'torch'")
        from pagedserve.attention.cpu_backend import CpuAttention
        return CpuAttention(kv_cache_dtype)
    if name == "torch":
        from pagedserve.attention.torch_backend import TorchAttention
        return TorchAttention(kv_cache_dtype)
    if name == "triton":
        if kv_cache_dtype != "auto":
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is not supported by the triton attention backend "
                             "(its kernels read 16-bit caches only); use kv_cache_dtype='auto', or "
                             "attention_backend='torch' (a reference) or the CPU")
        try:
            from pagedserve.attention.triton_backend import TritonAttention
        except ImportError as e:
            raise ValueError(f"attention_backend='triton' needs the triton package ({e}); "
                             "`pip install 'pagedserve[gpu]'` or use another attention_backend") from e
        return TritonAttention(device)
    raise ValueError(f"attention_backend must be one of {', '.join(BACKENDS)}; got {name!r}")
