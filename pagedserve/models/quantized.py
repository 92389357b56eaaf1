"""Quantized weights in the model: which mode a load runs in, the linear layers' dispatch, and the
embedding table kept in its GGUF blocks.

A matmul weight is a float tensor, a `QuantizedWeight` (GGML blocks: pagedserve/quant_format.py)
or, where a fused matrix's parts differ in type (a Q4_K_M file keeps v in Q6_K and q, k in Q4_K), a
tuple of them that the ops multiply as one product (concatenated where a part was dequantized: a
type without a kernel). The compute of quantized weights is the ops' (ModelOps.quantized_linear,
quantized_embedding): CpuOps runs kernels/quant.py, TorchOps the torch reference of
quant_format.py; this module imports no kernel.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from pagedserve.quant_format import QTYPES, QuantizedWeight, dequantize_torch, from_gguf_blocks, slice_rows

Weight = torch.Tensor | QuantizedWeight | tuple


def resolve_quantization(setting: str | None, gguf_dequantize: bool, is_gguf: bool,
                         device: torch.device) -> str | None:
    """The mode a load runs in: "gguf" (a GGUF file's blocks), "q8_0" / "q4_0" (an HF float model
    quantized at load) or None (float weights). `setting`: EngineConfig.quantization, already
    checked against what config.py can tell; here what needs the resolved model and device."""
    if setting is None:
        # The default for a GGUF file, where the quantized kernels run; a GPU keeps the float path.
        return "gguf" if is_gguf and not gguf_dequantize and device.type == "cpu" else None
    if device.type != "cpu":
        raise ValueError(f"quantization={setting!r} runs on the CPU only; the engine resolved device {device}: "
                         f"pass device='cpu'" + (", or gguf_dequantize=True" if is_gguf else ""))
    if setting == "gguf" and not is_gguf:
        raise ValueError("quantization='gguf' needs a .gguf model file; to quantize an HF float model at load, "
                         "pass quantization='q8_0' or 'q4_0'")
    if setting != "gguf" and is_gguf:
        raise ValueError(f"quantization={setting!r} quantizes an HF float model at load; this model is a .gguf "
                         f"file (quantization='gguf', the default, computes in its blocks)")
    return setting


def kernel_qtype(tensor_type) -> str | None:
    """quant's name of a GGML type (gguf.GGMLQuantizationType) that has a kernel, else None."""
    name = tensor_type.name.lower()
    return name if name in QTYPES else None


def linear_torch(x: torch.Tensor, weight: QuantizedWeight | tuple, bias: torch.Tensor | None = None,
                 decode: bool = False, out_dtype: torch.dtype | None = None, invariant: bool = False) -> torch.Tensor:
    """Quantized weights' product in plain torch (TorchOps): the weights dequantized exactly, then
    a float32 matmul; `decode` and `invariant` change nothing here."""
    parts = weight if isinstance(weight, tuple) else (weight,)
    w = torch.cat([dequantize_torch(p) for p in parts])
    out = F.linear(x.float(), w, None if bias is None else bias.float())
    return out.to(out_dtype or x.dtype)


def embedding_rows_torch(weight: QuantizedWeight, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of a quantized table in plain torch (TorchOps), one row dequantized at a time."""
    flat = ids.reshape(-1).tolist()
    if any(i < 0 or i >= weight.shape[0] for i in flat):
        raise IndexError(f"embedding: ids out of range for {weight.shape[0]} rows")
    rows = [dequantize_torch(slice_rows(weight, i, i + 1))[0] for i in flat]
    out = torch.stack(rows) if rows else torch.empty(0, weight.shape[1])
    return out.view(*ids.shape, weight.shape[1]).to(dtype)


def linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None, dense=F.linear,
           decode: bool = False, out_dtype: torch.dtype | None = None, quantized=linear_torch,
           invariant: bool = False) -> torch.Tensor:
    """x @ weight.T (+ bias) for any kind of weight; `dense`: the linear of float weights;
    `quantized`: that of quantized ones (CpuOps: kernels/quant.py's linear); `decode`: x holds
    decode tokens only (the integer path then takes larger batches); `invariant`: a batch-invariant
    step (each row computed as it would be alone); out_dtype: the result's (default x's; quantized
    weights write it from their float32 sums)."""
    if isinstance(weight, QuantizedWeight) or (
            isinstance(weight, tuple) and all(isinstance(part, QuantizedWeight) for part in weight)):
        return quantized(x, weight, bias, decode, out_dtype, invariant=invariant)   # (parts: one product, no concat)
    if isinstance(weight, tuple):        # parts of a fused matrix in different types, some dequantized
        out = torch.cat([linear(x, part, None, dense, decode, None, quantized, invariant) for part in weight], dim=1)
        out = out if bias is None else out.add_(bias)
    else:
        out = dense(x, weight, bias)
    return out if out_dtype is None else out.to(out_dtype)


def is_quantized(weight) -> bool:
    return isinstance(weight, (QuantizedWeight, QuantizedEmbedding)) or (
        isinstance(weight, tuple) and any(is_quantized(p) for p in weight))


def _storages(weight) -> list[torch.Tensor]:
    """The tensors holding a weight's bytes (of an MoE block: its router's, experts' and shared expert's)."""
    from pagedserve.models.moe import ExpertWeights, MoEWeights
    if isinstance(weight, MoEWeights):
        return [t for part in (weight.router, weight.router_bias, weight.shared_gate, weight.shared, *weight.experts)
                for t in _storages(part)]
    if isinstance(weight, ExpertWeights):
        return [t for part in (weight.gate_up, weight.down, weight.gate_up_bias, weight.down_bias)
                for t in _storages(part)]
    if weight is None:
        return []
    if isinstance(weight, tuple):
        return [t for part in weight for t in _storages(part)]
    if isinstance(weight, QuantizedWeight):
        return [weight.data] if isinstance(weight.data, torch.Tensor) else []
    if isinstance(weight, QuantizedEmbedding):
        return [weight.blocks]
    if isinstance(weight, torch.Tensor):
        return [weight]
    data = getattr(weight, "data", None)        # cpu.PackedWeight
    return [data] if isinstance(data, torch.Tensor) else []


def weight_nbytes(weight) -> int:
    """Bytes a weight holds in memory (a quantized one: its blocks)."""
    if isinstance(weight, QuantizedWeight):
        return weight.nbytes
    if isinstance(weight, tuple):
        return sum(weight_nbytes(p) for p in weight)
    return sum(t.numel() * t.element_size() for t in _storages(weight))


def model_weight_bytes(model) -> int:
    """Every weight's bytes in memory, each storage counted once (a tied LM head may read the
    embedding's blocks)."""
    from dataclasses import fields
    weights = [getattr(w, f.name) for w in getattr(model, "layers", []) for f in fields(w)]
    weights += [getattr(model, n, None) for n in ("embed", "norm", "lm_head")]
    seen: dict[tuple[int, int], int] = {}
    for weight in weights:
        for t in _storages(weight):
            seen[(t.data_ptr(), t.numel() * t.element_size())] = t.numel() * t.element_size()
    return sum(seen.values())


def quantized_qtypes(model) -> set[str]:
    """The block types of a model's quantized products (its layers' and the LM head's weights;
    the embedding's lookups dequantize rows): what the worker tells its ops, which say whether
    a batch-invariant step computes them with other arithmetic (ModelOps.invariance_changes)."""
    from dataclasses import fields

    from pagedserve.models.moe import ExpertWeights, MoEWeights

    def qtypes(weight) -> set[str]:
        if isinstance(weight, QuantizedWeight):
            return {weight.qtype}
        if isinstance(weight, tuple):
            return set().union(*(qtypes(p) for p in weight))
        if isinstance(weight, MoEWeights):
            return set().union(*(qtypes(e) for e in weight.experts + ([weight.shared] if weight.shared else [])))
        if isinstance(weight, ExpertWeights):
            return qtypes(weight.gate_up) | qtypes(weight.down)
        return set()
    weights = [getattr(w, f.name) for w in getattr(model, "layers", []) for f in fields(w)]
    return set().union(*(qtypes(w) for w in weights + [getattr(model, "lm_head", None)]))


def model_read_bytes_per_token(model) -> int:
    """The weight bytes one decode token reads: every layer's matrices and norms, but of an MoE
    block only its router, k experts (of their mean size) and shared expert; the final norm and
    the LM head (not the embedding: one row)."""
    from dataclasses import fields

    from pagedserve.models.moe import MoEWeights
    k = model.args.moe.top_k if getattr(model.args, "moe", None) else 0
    total = 0
    for w in model.layers:
        for f in fields(w):
            v = getattr(w, f.name)
            total += v.active_bytes(k) if isinstance(v, MoEWeights) else weight_nbytes(v)
    return total + weight_nbytes(model.norm) + weight_nbytes(model.lm_head)


@dataclass
class QuantizedEmbedding:
    """An embedding table kept in its GGUF blocks ([rows, bytes per row], possibly a view of the
    memory-mapped file): a lookup dequantizes only the rows of the step's tokens (one row per
    token, so the cost is small next to the layers). Any GGML type works: one with a kernel is
    dequantized by the ops (CpuOps: kernels/quant.py), any other by the gguf package. `owned`:
    blocks is a copy (not the file's mapping), which a tied LM head may repack in place (`weight`
    then in that layout, which the lookups read too)."""
    tensor_type: object          # gguf.GGMLQuantizationType
    blocks: torch.Tensor         # uint8 [rows, bytes per row]
    cols: int
    dtype: torch.dtype
    owned: bool = False

    @property
    def shape(self) -> tuple[int, int]:
        return self.blocks.shape[0], self.cols

    def __post_init__(self) -> None:
        qtype = kernel_qtype(self.tensor_type)
        # The table as a QuantizedWeight over the same blocks (None: a type without a kernel).
        self.weight = None if qtype is None else from_gguf_blocks(qtype, self.blocks, self.shape)

    def lookup(self, ids: torch.Tensor, rows=embedding_rows_torch) -> torch.Tensor:
        """`rows`: the ops' quantized_embedding (CpuOps: the compiled row dequantize)."""
        if self.weight is not None:        # the gguf package's values
            return rows(self.weight, ids, self.dtype)
        rows = self.blocks[ids.to(torch.int64)]
        from gguf import quants
        return torch.from_numpy(np.asarray(quants.dequantize(rows.numpy(), self.tensor_type),
                                           dtype=np.float32)).to(self.dtype)


def embedding(ids: torch.Tensor, table, ops=None) -> torch.Tensor:
    """Rows `ids` of a float or quantized table (ops: whose quantized_embedding looks it up)."""
    if isinstance(table, QuantizedEmbedding):
        return table.lookup(ids) if ops is None else table.lookup(ids, ops.quantized_embedding)
    return F.embedding(ids, table)
