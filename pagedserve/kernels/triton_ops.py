"""ModelOps on a CUDA GPU with the Triton attention backend: plain torch (TorchOps) for the dense
math, and a mixture-of-experts layer's routed experts as one grouped GEMM (kernels/triton_moe.py).

The worker picks these where the model runs on CUDA with attention_backend "triton"
(worker/worker.py make_ops); the CPU keeps CpuOps. Under TRITON_INTERPRET=1 they also run on
CPU tensors (slowly: the tests)."""
from __future__ import annotations

import logging

import torch

from pagedserve.kernels.triton_moe import ExpertStack, grouped_moe, stack_experts
from pagedserve.models.ops import TorchOps

logger = logging.getLogger(__name__)


class TritonOps(TorchOps):
    def __init__(self) -> None:
        self._stacks: dict[int, ExpertStack] = {}      # by id of a layer's experts list (the stack holds it)

    def describe(self) -> str:
        return "Triton grouped GEMM for MoE experts" if self._stacks else ""

    def prepare_weights(self, model) -> None:
        """Each MoE layer's float experts stacked once ([E, 2 I, H], [E, H, I]; the experts then
        view them); a layer whose experts do not stack keeps the one-by-one loop."""
        for layer in getattr(model, "layers", []):
            moe = getattr(layer, "moe", None)
            if moe is not None and id(moe.experts) not in self._stacks:
                stack = stack_experts(moe.experts)
                if stack is not None:
                    self._stacks[id(moe.experts)] = stack
        if self._stacks:
            logger.info("MoE experts: a Triton grouped GEMM in %d layers", len(self._stacks))

    def routed_experts(self, h: torch.Tensor, experts: list, weights: torch.Tensor,
                       ids: torch.Tensor, spec) -> torch.Tensor | None:
        stack = self._stacks.get(id(experts))
        if stack is None or stack.experts is not experts:
            return None
        return grouped_moe(h, stack, weights, ids, spec.activation, spec.swiglu_alpha, spec.swiglu_limit)
