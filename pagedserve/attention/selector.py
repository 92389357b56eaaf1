"""Pick the attention backend: cpu (compiled C++ decode kernel), torch (the reference),
or triton (GPU kernels)."""
from __future__ import annotations

import torch

from pagedserve.config import ATTENTION_BACKENDS as BACKENDS


def make_attention_backend(name: str | None, device: torch.device):
    """None: triton on CUDA, cpu elsewhere. triton on a CPU runs Triton's interpreter
    (slow; for tests), which needs TRITON_INTERPRET=1 before triton is imported."""
    name = name or ("triton" if device.type == "cuda" else "cpu")
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError(f"attention_backend='cpu' runs on the CPU, not on {device}; use 'triton' or 'torch'")
        from pagedserve.attention.cpu_backend import CpuAttention
        return CpuAttention()
    if name == "torch":
        from pagedserve.attention.torch_backend import TorchAttention
        return TorchAttention()
    if name == "triton":
        try:
            from pagedserve.attention.triton_backend import TritonAttention
        except ImportError as e:
            raise ValueError(f"attention_backend='triton' needs the triton package ({e}); "
                             "`pip install 'pagedserve[gpu]'` or use another attention_backend") from e
        return TritonAttention(device)
    raise ValueError(f"attention_backend must be one of {', '.join(BACKENDS)}; got {name!r}")
