"""ModelOps on the CPU: the compiled kernels of kernels/cpu.py.

Each call goes to the active kernel variant (avx512bf16, avx512, avx2 or scalar, chosen
at run time; `cpu.use_variant` switches it for every call after). Where a kernel does
not apply to a call (a dtype without a kernel, strides it does not take, no compiler to
build the kernels) the torch reference (TorchOps) runs instead.
"""
from __future__ import annotations

import logging

import torch

from pagedserve.attention.cpu_backend import CpuAttention
from pagedserve.attention.metadata import AttentionMetadata
from pagedserve.kernels import cpu, quant
from pagedserve.kernels import moe as moe_kernels
from pagedserve.models import quantized
from pagedserve.models.ops import TorchOps

logger = logging.getLogger(__name__)


class CpuOps(TorchOps):
    def __init__(self) -> None:
        self._expert_tables: dict[int, tuple] = {}      # routed_experts' tables, by id of the experts' list
    @property
    def bf16_is_fast(self) -> bool:
        return cpu.auto_keeps_bf16()

    def describe(self) -> str:
        return (f"CPU kernels: {cpu.variant() or 'none (torch fallbacks)'} "
                f"(CPU supports {', '.join(cpu.supported_variants())}; {cpu.describe_amx()})")

    def prepare_weights(self, model) -> None:
        """Every matmul weight packed once into the tiles of our GEMMs (see cpu.pack_weight). A
        tied LM head gets its own packed copy; the embedding table stays plain for lookups.
        With the CPU attention backend, the whole layer loop then runs as one compiled call
        (not under tensor parallelism: its all-reduces run between the layers' matmuls). Quantized
        weights (models/quantized.py) stay as they are (kernels/quant.py computes them in their
        blocks); the compiled loop runs them too, through quant's kernels (cpu.DecoderLayers), where
        those are built; else the Python layer loop runs, over the same kernels."""
        from pagedserve.models.loader import trim_heap
        for w in model.layers:
            for name in ("qkv", "o", "gate_up", "down"):      # one at a time: each plain copy freed first
                setattr(w, name, _pack(getattr(w, name)))
            if w.moe is not None:
                for e in w.moe.experts + ([w.moe.shared] if w.moe.shared else []):
                    e.gate_up, e.down = _pack(e.gate_up), _pack(e.down)
            trim_heap()             # the plain copies just freed, back to the system: peak memory
        model.lm_head = _pack(model.lm_head)
        trim_heap()
        beyond = model.needs_python_layers()
        if beyond:
            logger.info("the Python layer loop runs this model (the compiled loop lacks %s)", ", ".join(beyond))
        if model.tp is None and isinstance(model.attention, CpuAttention) and not beyond and \
                cpu.DecoderLayers.supports(model, model.attention.kv_format.code):
            model.compiled_layers = CpuDecoderLayers(model)

    @staticmethod
    def linear(x: torch.Tensor, weight, bias: torch.Tensor | None = None, decode: bool = False,
               out_dtype: torch.dtype | None = None, invariant: bool = False) -> torch.Tensor:
        """Plain, packed (prepare_weights packs them) or quantized weights (`decode`, out_dtype,
        `invariant`: models/quantized.py's)."""
        if isinstance(weight, cpu.PackedWeight):
            out = cpu.linear(x, weight, bias)
            return out if out_dtype is None else out.to(out_dtype)
        return quantized.linear(x, weight, bias, cpu.linear, decode, out_dtype, quant.linear, invariant)

    # Quantized weights through kernels/quant.py (C++ where built, its torch fallbacks else).
    quantize = staticmethod(quant.quantize)
    repack = staticmethod(quant.repack)
    quantized_linear = staticmethod(quant.linear)
    quantized_embedding = staticmethod(quant.embedding)
    invariance_changes = staticmethod(quant.invariance_changes)

    argmax = staticmethod(cpu.argmax_rows)

    def routed_experts(self, h: torch.Tensor, experts: list, weights: torch.Tensor,
                       ids: torch.Tensor, spec) -> torch.Tensor | None:
        """Quantized experts (SwiGLU, or gpt-oss's clamped SwiGLU with biases) in one C++ call
        (kernels/moe.py); the experts' table is built once per list of experts (kept while the list
        lives: a layer's MoEWeights.experts)."""
        key = id(experts)
        cached = self._expert_tables.get(key)
        if cached is None or cached[0] is not experts:
            cached = self._expert_tables[key] = (experts, moe_kernels.expert_table(experts))
        return None if cached[1] is None else moe_kernels.routed_experts(h, cached[1], weights, ids,
                                                                          moe_kernels.glu_of(spec))

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dim() == 2 and (normed := cpu.add_rms_norm(x, None, weight, eps)) is not None:
            return normed
        return super().rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """One fused kernel that updates x in place."""
        normed = cpu.add_rms_norm(x, y, weight, eps)
        if normed is not None:
            return x, normed
        x = x + y
        return x, self.rms_norm(x, weight, eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        out = cpu.silu_and_mul(gate_up)
        return out if out is not None else super().silu_and_mul(gate_up)

    def rotate_queries_and_keys(self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                                cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE in place in qkv (one kernel; partial rotary too)."""
        num_tokens, heads = qkv.shape[0], num_heads + num_kv_heads
        if not cpu.rope_inplace(qkv, heads, head_dim, cos.view(num_tokens, -1), sin.view(num_tokens, -1)):
            return super().rotate_queries_and_keys(qkv, num_heads, num_kv_heads, head_dim, cos, sin)
        qk = qkv[:, :heads * head_dim].view(num_tokens, heads, head_dim)
        return qk[:, :num_heads], qk[:, num_heads:]


def _pack(weight):
    if isinstance(weight, torch.Tensor):
        return cpu.pack_weight(weight)
    if isinstance(weight, tuple):
        return tuple(_pack(part) for part in weight)
    return weight


class CpuDecoderLayers:
    """The compiled layer loop (cpu.DecoderLayers) fed the CPU attention backend's query rows."""

    def __init__(self, model) -> None:
        self.layers = cpu.DecoderLayers(model, model.attention.kv_format.code)     # 8-bit KV cache too
        self.attention: CpuAttention = model.attention
        self.model = model            # its kv_groups, set by the runner after the load
        self.num_layers = model.args.num_layers
        self._lora: cpu.LoraTable | None = None      # the last slot range's weight addresses

    def forward(self, x: torch.Tensor, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_caches: torch.Tensor, meta: AttentionMetadata, lora=None,
                local: tuple[torch.Tensor, torch.Tensor] | None = None) -> bool:
        """lora: a step with adapter rows (lora/weights.py LoRAStep) whose deltas the loop
        computes (`compiled`): its table of weight addresses made once per slot range (until a slot is reloaded).
        local: the window layers' own RoPE tables (Gemma 3). A hybrid model's layers attend with
        their KV group's rows (meta.groups) over their cache slots (model.kv_groups)."""
        groups = self.model.kv_groups
        if groups is not None:
            self.layers.set_groups(groups.layer_group, groups.layer_slot)
        metas = meta.groups or [meta]
        rows = [self.attention.kernel_rows(m) for m in metas]
        deltas = None
        if lora is not None:
            key, table = lora.compiled_key(), self._lora
            if table is None or table.key != key:
                table = self._lora = cpu.LoraTable(self.num_layers, key, *lora.compiled_weights())
            row_block = lora.row_blocks()
            if not table.ok:
                return False
            deltas = (table, row_block)
        return self.layers.forward(x, h, cos, sin, kv_caches, [m.slot_mapping for m in metas], rows, deltas, local,
                                   meta.batch_invariant)
