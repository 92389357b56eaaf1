"""PEFT LoRA adapters: find one (a local directory or a Hub id), check it against the base
model before anything is loaded, and read its tensors.

A PEFT directory holds adapter_config.json (r, lora_alpha, use_rslora, target_modules) and
adapter_model.safetensors, whose tensors are named
`...layers.{i}.self_attn.q_proj.lora_A.weight` ([r, in]) and `...lora_B.weight` ([out, r]).
The front end (engine) calls `read_adapter` once per adapter: it reads the config and the
safetensors header only, so a bad adapter is refused with a clear InvalidRequestError (a 400 on
the server) and nothing else is touched. The worker reads the checked spec's tensors with `read_tensors`.
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pagedserve.errors import InvalidRequestError

# The projections an adapter may target: PEFT's module names -> our part names. A part is one
# block of output columns of a (possibly fused) linear: q/k/v of qkv, gate/up of gate_up.
PEFT_MODULES = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o",
                "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
PARTS = tuple(PEFT_MODULES.values())
# Fused projections of some architectures (Phi-3's qkv_proj and gate_up_proj): one lora_A, and a
# lora_B whose rows are its parts' in order; each part is served as its own (A, rows of B).
FUSED_PEFT_MODULES = {"qkv_proj": ("q", "k", "v"), "gate_up_proj": ("gate", "up")}
_MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)\.lora_([AB])(?:\.\w+)?\.weight$")


class LoRAAdapterError(InvalidRequestError):
    """An adapter that cannot be served over this base model; the message says why."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "lora_request")

    def __reduce__(self):
        return (type(self), (self.message,))


class LoRAReadError(LoRAAdapterError):
    """An adapter checked before that the worker could not read in a step (its files changed on
    disk): the requests using it fail, nothing else."""

    def __init__(self, message: str, lora_int_id: int) -> None:
        super().__init__(message)
        self.lora_int_id = lora_int_id

    def __reduce__(self):
        return (type(self), (self.message, self.lora_int_id))


@dataclass(frozen=True)
class AdapterSpec:
    """A checked adapter: where its tensors are, its rank and scale, and which (layer, part)
    pairs it adapts (each with the names of its A and B tensors, and where B is a fused
    module's, the part's rows of it)."""
    path: str
    rank: int
    scaling: float
    tensors: dict[tuple[int, str], tuple[str, str]]
    b_rows: dict[tuple[int, str], tuple[int, int]] = field(default_factory=dict)

    @property
    def parts(self) -> frozenset[str]:
        return frozenset(p for _, p in self.tensors)


def part_shapes(args) -> dict[str, tuple[int, int]]:
    """Each part's (in, out) features in the base model (one process: whole shapes)."""
    h, q, kv, inter = args.hidden_size, args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim, \
        args.intermediate_size
    return {"q": (h, q), "k": (h, kv), "v": (h, kv), "o": (q, h), "gate": (h, inter), "up": (h, inter),
            "down": (inter, h)}


def resolve_adapter(name: str, lora_name: str) -> Path:
    """A local directory for an adapter path: the directory itself, else the Hub snapshot of
    repository `name` (huggingface_hub's cache and offline mode, as for models)."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    if path.exists() or name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise LoRAAdapterError(f"LoRA adapter {lora_name!r}: {name!r} is not a directory (give a PEFT directory "
                               f"with {CONFIG_FILE} and {WEIGHTS_FILE}, or a Hub id)")
    from huggingface_hub import snapshot_download
    try:
        return Path(snapshot_download(name, allow_patterns=[CONFIG_FILE, WEIGHTS_FILE]))
    except Exception as e:   # noqa: BLE001 - every Hub failure is one clear refusal
        raise LoRAAdapterError(f"LoRA adapter {lora_name!r}: {name!r} is neither a local directory nor a "
                               f"reachable Hub adapter ({type(e).__name__})") from None


def read_adapter(name: str, lora_name: str, args, max_lora_rank: int) -> AdapterSpec:
    """Check an adapter against the base model (`args`: its ModelArgs) and max_lora_rank, reading
    its config and the safetensors header only. Raises LoRAAdapterError."""
    def fail(why: str) -> LoRAAdapterError:
        return LoRAAdapterError(f"LoRA adapter {lora_name!r} ({name}): {why}")

    root = resolve_adapter(name, lora_name)
    if not (root / CONFIG_FILE).is_file():
        raise fail(f"no {CONFIG_FILE} (a PEFT adapter directory holds {CONFIG_FILE} and {WEIGHTS_FILE})")
    if not (root / WEIGHTS_FILE).is_file():
        raise fail(f"no {WEIGHTS_FILE} (only safetensors weights are read, not adapter_model.bin)")
    try:
        cfg = json.loads((root / CONFIG_FILE).read_text())
    except (OSError, ValueError) as e:
        raise fail(f"{CONFIG_FILE} is not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise fail(f"{CONFIG_FILE} must hold a JSON object; got {type(cfg).__name__}")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise fail(f"peft_type is {cfg.get('peft_type')!r}; only LORA adapters are served")
    rank = cfg.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise fail(f"r must be an int >= 1; got {rank!r}")
    if rank > max_lora_rank:
        raise fail(f"its rank r={rank} is above max_lora_rank={max_lora_rank} (--max-lora-rank)")
    for key in ("use_dora", "rank_pattern", "alpha_pattern", "bias", "modules_to_save", "fan_in_fan_out"):
        if cfg.get(key) not in (None, False, "none", [], {}):    # each one's "off" value
            raise fail(f"{key}={cfg[key]!r} is not supported")
    targets = cfg.get("target_modules")
    if targets is not None and not isinstance(targets, str) and not (
            isinstance(targets, list) and all(isinstance(t, str) for t in targets)):
        raise fail(f"target_modules must be a string or a list of strings; got {targets!r}")
    if isinstance(targets, list):
        unknown = sorted({t.split(".")[-1] for t in targets} - set(PEFT_MODULES) - set(FUSED_PEFT_MODULES))
        if unknown:
            raise fail(f"target_modules {unknown} are not among {', '.join([*PEFT_MODULES, *FUSED_PEFT_MODULES])}")
    alpha = cfg.get("lora_alpha", rank)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise fail(f"lora_alpha must be a number; got {alpha!r}")
    if not isinstance(cfg.get("use_rslora", False), bool):
        raise fail(f"use_rslora must be true or false; got {cfg['use_rslora']!r}")
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    shapes = part_shapes(args)
    from safetensors import safe_open
    try:
        with safe_open(root / WEIGHTS_FILE, framework="pt") as f:
            found = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as e:   # noqa: BLE001 - a corrupt file is a refusal, not a crash
        raise fail(f"{WEIGHTS_FILE} cannot be read ({e})") from None
    names: dict[tuple[int, str], dict[str, str]] = {}
    b_rows: dict[tuple[int, str], tuple[int, int]] = {}
    moe = getattr(args, "moe", None)
    for key, shape in found.items():
        m = _KEY.search(key)
        if moe is not None and (".experts." in key or "block_sparse_moe." in key or ".mlp.gate." in key or (
                m is not None and m.group(2) in _MLP_MODULES and moe.is_sparse(int(m.group(1))))):
            raise fail(f"tensor {key!r} adapts a mixture-of-experts block: on MoE models LoRA covers the attention "
                       f"projections (q/k/v/o_proj) and dense MLP layers only, never experts or routers")
        if m is None or (m.group(2) not in PEFT_MODULES and m.group(2) not in FUSED_PEFT_MODULES):
            raise fail(f"tensor {key!r} is not a lora_A/lora_B of {', '.join([*PEFT_MODULES, *FUSED_PEFT_MODULES])}")
        layer, ab = int(m.group(1)), m.group(3)
        parts = FUSED_PEFT_MODULES.get(m.group(2)) or (PEFT_MODULES[m.group(2)],)
        if layer >= args.num_layers:
            raise fail(f"tensor {key!r}: layer {layer}, but the base model has {args.num_layers} layers")
        fan_in, fan_out = shapes[parts[0]][0], sum(shapes[p][1] for p in parts)
        want = [rank, fan_in] if ab == "A" else [fan_out, rank]
        if shape != want:
            raise fail(f"tensor {key!r} has shape {shape}, expected {want} (r={rank} over the base model's "
                       f"{m.group(2)} of {fan_in} -> {fan_out}): an adapter of another base model?")
        row = 0
        for part in parts:
            names.setdefault((layer, part), {})[ab] = key
            if len(parts) > 1 and ab == "B":
                b_rows[(layer, part)] = (row, row + shapes[part][1])
            row += shapes[part][1]
    if not names:
        raise fail(f"{WEIGHTS_FILE} holds no LoRA tensors")
    half = sorted(k for k, v in names.items() if len(v) != 2)
    if half:
        raise fail(f"layer {half[0][0]} {half[0][1]}_proj has only one of lora_A and lora_B")
    return AdapterSpec(str(root), rank, float(scaling), {k: (v["A"], v["B"]) for k, v in names.items()}, b_rows)


def adapter_fingerprint(path: str) -> str:
    """A hash of an adapter directory's content (its config and weights, every byte): what its
    prefix-cache blocks are keyed by (with its id), so changed files never meet the old blocks."""
    import hashlib
    h = hashlib.sha256()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        h.update(name.encode())
        try:
            with open(Path(path) / name, "rb") as f:
                while chunk := f.read(1 << 20):
                    h.update(chunk)
        except OSError:
            h.update(b"(unreadable)")
    return h.hexdigest()[:32]


def read_tensors(spec: AdapterSpec) -> Iterator[tuple[int, str, torch.Tensor, torch.Tensor]]:
    """(layer, part, A [r, in], B [out, r]) of each adapted pair, as the file holds them (its
    dtype, B without the scale): views of the mapped file, one pair at a time."""
    from safetensors import safe_open
    with safe_open(str(Path(spec.path) / WEIGHTS_FILE), framework="pt") as f:
        for (layer, part), (a, b) in spec.tensors.items():
            rows = spec.b_rows.get((layer, part))
            weight_b = f.get_tensor(b) if rows is None else f.get_slice(b)[rows[0]:rows[1]]
            yield layer, part, f.get_tensor(a), weight_b
