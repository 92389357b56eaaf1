"""How each architecture we run differs from Llama: the one place that says so.

Every decoder in models/llama.py is Llama's: pre-norm RMSNorm, rotary attention with grouped KV
heads, a SiLU-gated MLP, an LM head tied to the embedding or not. An `Architecture` below lists
only where a family departs from that: its names (HF `architectures` and `model_type`, GGUF's
`general.architecture`), what its config or GGUF metadata adds to `ModelArgs` (q/k norms, partial
rotary, layers without RoPE, multipliers, RoPE scaling), and how its checkpoints name tensors
that Llama's do not have or name otherwise (a fused qkv_proj, q_norm / k_norm, llama.cpp's
rope_freqs). models/loader.py reads configs, GGUF metadata and tensor names through it;
models/llama.py runs whatever `ModelArgs` says.

Adding an architecture:
1. Add an `Architecture(...)` to `ARCHITECTURES`: its names, and the fields where it differs
   (everything left out is Llama's).
2. Config keys of its own: an `hf_config` function from the config dict to `ModelArgs` fields,
   and a `gguf_config` one from the GGUF metadata (`Metadata`: its keys without the
   `<arch>.` prefix) to the same fields.
3. Tensors Llama lacks or names otherwise: `gguf_tensors` (GGUF layer kind -> HF module), and
   a field of `ModelArgs` the loader reads them by (e.g. `qk_norm` -> self_attn.q_norm); fused
   checkpoint tensors: `fused_qkv` / `fused_gate_up` (`qkv_parts`, `gate_up_parts` give the rows,
   tensor parallelism included); a GGUF kind of another shape than Llama's: its shape in
   models/gguf_check.py `expected_shapes` (files from strangers are checked against it).
4. Math Llama lacks: a `ModelArgs` field whose default is Llama's behaviour, used in
   `LlamaModel.forward`; if the compiled CPU layer loop does not do it, list it in
   `llama.beyond_compiled_loop` (the Python loop then runs that model).
5. Tests (tests/test_architectures.py): a tiny transformers config with every distinguishing
   feature on, whose greedy tokens and logprobs ours must equal, and the same model written as
   llama.cpp writes its GGUF.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagedserve.models import moe_weights
from pagedserve.models.moe_weights import GGUF_MOE_TENSORS

# GGUF's layer tensor kinds (blk.<i>.<kind>.weight) and top-level tensors as llama.cpp names them,
# with the HF module (under `model.layers.<i>.`) or tensor each holds. An architecture adds or
# overrides kinds with `gguf_tensors`.
GGUF_LAYER_TENSORS = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    **GGUF_MOE_TENSORS,        # routers and experts (stacked: ffn_*_exps), where a file has them
}
GGUF_TOP_TENSORS = {
    "token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
}
# Top-level GGUF tensors that are RoPE settings, not weights: read with the metadata (gguf_rope).
GGUF_ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


class Metadata:
    """A GGUF file's metadata under one architecture's prefix: `get("attention.head_count")` reads
    `<arch>.attention.head_count`; `top("general.name")` a key as it is."""

    def __init__(self, reader, arch: str) -> None:
        self.reader, self.prefix = reader, arch + "."

    def top(self, name: str, default: Any = None) -> Any:
        f = self.reader.fields.get(name)
        return default if f is None else f.contents()

    def get(self, name: str, default: Any = None) -> Any:
        return self.top(self.prefix + name, default)

    def tensor(self, name: str):
        """A small top-level tensor's values as a list of floats (None if the file has none)."""
        import numpy as np
        for t in self.reader.tensors:
            if t.name == name:
                return np.asarray(t.data, dtype=np.float32).reshape(-1).tolist()
        return None


@dataclass(frozen=True)
class Architecture:
    name: str                                   # ours, short: "qwen3"
    hf_architectures: tuple[str, ...]           # config.json "architectures"
    model_types: tuple[str, ...] = ()           # config.json "model_type"
    gguf_architecture: str | None = None        # GGUF general.architecture
    # Attention
    qkv_bias: bool | None = None                # always (Qwen2) / never; None: the config's attention_bias
    qk_norm: bool = False                       # RMSNorm of each q and k head before RoPE (Qwen3)
    # Checkpoint layout
    fused_qkv: bool = False                     # HF stores self_attn.qkv_proj (Phi-3), not q/k/v_proj
    fused_gate_up: bool = False                 # HF stores mlp.gate_up_proj (Phi-3)
    gguf_rotary_permuted: bool = False          # llama.cpp's converter permuted q/k rows (its LlamaModel)
    gguf_tensors: dict[str, str] = field(default_factory=dict)   # extra GGUF layer kinds -> HF modules
    # Config keys of its own -> ModelArgs fields (beyond the shared ones read in loader.py)
    hf_config: Callable[[dict], dict] | None = None
    gguf_config: Callable[[Metadata], dict] | None = None

    def hf_names(self) -> str:
        return ", ".join(self.hf_architectures)

    def qkv_parts(self, layer: str, rows: dict[str, Rows], q_size: int, kv_size: int,
                  suffix: str = "weight", fused: bool | None = None) -> list[tuple[str, Rows]]:
        """The checkpoint tensors (HF names under `layer`, e.g. "layers.3.") and their rows that
        make the fused q/k/v matrix (or bias), given the rows of q, k and v wanted (a
        tensor-parallel rank's heads: rows["q"] = (start, end)). fused: whether this checkpoint
        stores qkv_proj (None: the architecture's way; a Phi-3 GGUF file may hold attn_q/k/v)."""
        if not (self.fused_qkv if fused is None else fused):
            return [(f"{layer}self_attn.{n}_proj.{suffix}", rows[n]) for n in "qkv"]
        name = f"{layer}self_attn.qkv_proj.{suffix}"
        at = {"q": 0, "k": q_size, "v": q_size + kv_size}
        return _merged([(name, (at[n] + rows[n][0], at[n] + rows[n][1])) for n in "qkv"])

    def gate_up_parts(self, layer: str, rows: Rows, intermediate: int) -> list[tuple[str, Rows]]:
        """The checkpoint tensors and rows that make the fused gate/up matrix (rows: a rank's part
        of the intermediate dimension, None: all)."""
        if not self.fused_gate_up:
            return [(f"{layer}mlp.gate_proj.weight", rows), (f"{layer}mlp.up_proj.weight", rows)]
        r0, r1 = rows or (0, intermediate)
        name = f"{layer}mlp.gate_up_proj.weight"
        return _merged([(name, (r0, r1)), (name, (intermediate + r0, intermediate + r1))])


Rows = tuple[int, int] | None       # [start, end) of a tensor's rows; None: all of them


def _merged(parts: list[tuple[str, Rows]]) -> list[tuple[str, Rows]]:
    """Adjacent row ranges of the same tensor as one part (a whole fused tensor is read as one)."""
    out: list[tuple[str, Rows]] = []
    for name, rows in parts:
        if out and out[-1][0] == name and out[-1][1][1] == rows[0]:
            out[-1] = (name, (out[-1][1][0], rows[1]))
        else:
            out.append((name, rows))
    return out


def _smollm3_hf(cfg: dict) -> dict:
    """SmolLM3's no_rope_layers is a per-layer flag, 1 where the layer uses RoPE."""
    n = cfg["num_hidden_layers"]
    flags = cfg.get("no_rope_layers") or [int((i + 1) % cfg.get("no_rope_layer_interval", 4) != 0) for i in range(n)]
    return {"no_rope_layers": tuple(i for i, use in enumerate(flags) if not use)}


def _smollm3_gguf(m: Metadata) -> dict:
    # llama.cpp writes no key for it: every 4th layer has no RoPE (its smollm3 loader's constant)
    return {"no_rope_layers": tuple(i for i in range(m.get("block_count")) if (i + 1) % 4 == 0)}


def _granite_hf(cfg: dict) -> dict:
    return {"embedding_multiplier": float(cfg.get("embedding_multiplier", 1.0)),
            "residual_multiplier": float(cfg.get("residual_multiplier", 1.0)),
            "attention_multiplier": float(cfg.get("attention_multiplier", 1.0)),   # the softmax scale itself
            "logits_scaling": float(cfg.get("logits_scaling", 1.0))}


def _granite_gguf(m: Metadata) -> dict:
    # llama.cpp's converter writes each only where the config's is non-zero; a missing
    # attention.scale means 1 / sqrt(head_dim), as in llama.cpp
    return {"embedding_multiplier": float(m.get("embedding_scale") or 1.0),
            "residual_multiplier": float(m.get("residual_scale") or 1.0),
            "attention_multiplier": float(m.get("attention.scale") or 0.0),
            "logits_scaling": float(m.get("logit_scale") or 1.0)}


def _llama_gguf(m: Metadata) -> dict:
    """A `llama` file with experts is Mixtral's (llama.cpp converts Mixtral as Llama)."""
    moe = moe_weights.gguf_moe_spec(m, norm_default=True)
    return {"moe": moe, "architecture": "MixtralForCausalLM"} if moe else {}


def _olmoe_gguf(m: Metadata) -> dict:
    return {"moe": moe_weights.gguf_moe_spec(m, norm_default=False), "qk_norm_full": True}


def _qwen3moe_gguf(m: Metadata) -> dict:
    return {"moe": moe_weights.gguf_moe_spec(m, norm_default=True)}     # llama.cpp renormalises Qwen3-MoE's


# ---- Gemma 2 / 3: sliding-window and full layers (kv/groups.py), sandwich norms, GeGLU ------------
# llama.cpp's Gemma tensors: the attention output's norm, the MLP's input norm (ffn_norm, which is
# Llama's post-attention norm) and the MLP output's norm.
GEMMA_GGUF_TENSORS = {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                      "post_ffw_norm": "post_feedforward_layernorm"}
_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")


def _gemma_common(hidden: int, window: int | None, layer_windows: tuple, scale: float) -> dict:
    return dict(layer_windows=layer_windows, sliding_window=window, sandwich_norms=True, mlp_activation="gelu_tanh",
                embedding_multiplier=hidden ** 0.5, attention_multiplier=scale)


def _gemma_hf(cfg: dict, pattern: int) -> dict:
    """A Gemma config: its layer types (every `pattern`-th layer full where the config lists none),
    softcaps, query_pre_attn_scalar; its norms store w for (1 + w) (norm_offset)."""
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in _GELU_TANH:
        raise ValueError(f"{cfg.get('model_type')}: hidden_activation {act!r} is not supported (gelu_pytorch_tanh)")
    n, window = cfg["num_hidden_layers"], cfg.get("sliding_window")
    types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    out = _gemma_common(cfg["hidden_size"], window, tuple(window if t == "sliding_attention" else None for t in types),
                        (cfg.get("query_pre_attn_scalar") or head_dim) ** -0.5)
    return dict(out, norm_offset=1.0, attn_logit_softcapping=float(cfg.get("attn_logit_softcapping") or 0.0),
                final_logit_softcapping=float(cfg.get("final_logit_softcapping") or 0.0))


def _gemma3_rope(cfg: dict) -> dict:
    """Gemma 3's two RoPEs: the full layers' (rope_theta, maybe scaled) and the window layers'
    (rope_local_base_freq, unscaled); transformers 5 nests them in rope_parameters by layer type."""
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params:
        full, local = dict(params["full_attention"]), dict(params.get("sliding_attention") or {})
    else:
        full, local = {**params, **(cfg.get("rope_scaling") or {})}, {}
    theta = full.pop("rope_theta", None) or cfg.get("rope_theta") or 1_000_000.0
    local_theta = local.get("rope_theta") or cfg.get("rope_local_base_freq") or 10_000.0
    if "type" in full and "rope_type" not in full:
        full["rope_type"] = full.pop("type")
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"gemma3: scaled RoPE on the sliding-window layers ({local}) is not supported")
    return dict(rope_theta=float(theta), local_rope_theta=float(local_theta),
                rope_scaling=None if full.get("rope_type", "default") == "default" else full)


def _gemma_gguf(m: Metadata, pattern: int, big_layers: int) -> dict:
    """A Gemma GGUF file as llama.cpp reads it: every `pattern`-th layer full (layer il is a window
    layer where il % pattern < pattern - 1), norms already stored as 1 + w, the query scale
    1 / sqrt(head_dim) but for the 27B shapes (`big_layers` layers: 1 / sqrt(hidden / heads))."""
    n, hidden, heads = m.get("block_count"), m.get("embedding_length"), m.get("attention.head_count")
    pattern = m.get("attention.sliding_window_pattern") or pattern
    window = m.get("attention.sliding_window")
    head_dim = m.get("attention.key_length") or hidden // heads
    scale = (hidden // heads if n == big_layers else head_dim) ** -0.5
    return dict(_gemma_common(hidden, window, tuple(window if i % pattern < pattern - 1 else None for i in range(n)),
                              scale),
                attn_logit_softcapping=float(m.get("attn_logit_softcapping") or 0.0),
                final_logit_softcapping=float(m.get("final_logit_softcapping") or 0.0))


ARCHITECTURES: list[Architecture] = [
    Architecture("llama", ("LlamaForCausalLM",), ("llama",), "llama", gguf_rotary_permuted=True,
                 gguf_config=_llama_gguf),
    # Mistral's GGUF files are `llama` ones (llama.cpp converts them as Llama).
    Architecture("mistral", ("MistralForCausalLM",), ("mistral",)),
    Architecture("qwen2", ("Qwen2ForCausalLM",), ("qwen2",), "qwen2", qkv_bias=True),
    Architecture("qwen3", ("Qwen3ForCausalLM",), ("qwen3",), "qwen3", qk_norm=True),
    # Mixtures of experts (models/moe.py: the MoE block in the MLP's place). Mixtral's GGUF files are
    # `llama` ones with experts (_llama_gguf).
    Architecture("mixtral", ("MixtralForCausalLM",), ("mixtral",), gguf_rotary_permuted=True,
                 hf_config=moe_weights.mixtral_config),
    Architecture("olmoe", ("OlmoeForCausalLM",), ("olmoe",), "olmoe", qk_norm=True,
                 hf_config=moe_weights.olmoe_config, gguf_config=_olmoe_gguf),
    # gpt-oss (YaRN RoPE): HF directories (bf16 or MXFP4 experts) and llama.cpp's `gpt-oss` files (MXFP4
    # experts stacked per projection, with their biases; the sinks as attn_sinks; the MLP's input norm
    # as post_attention_norm)
    Architecture("gpt_oss", ("GptOssForCausalLM",), ("gpt_oss",), "gpt-oss", qkv_bias=True,
                 gguf_tensors={"attn_sinks": "self_attn.sinks", "post_attention_norm": "post_attention_layernorm"},
                 hf_config=moe_weights.gpt_oss_config, gguf_config=moe_weights.gpt_oss_gguf_config),
    Architecture("qwen3_moe", ("Qwen3MoeForCausalLM",), ("qwen3_moe",), "qwen3moe", qk_norm=True,
                 hf_config=moe_weights.qwen_moe_config, gguf_config=_qwen3moe_gguf),
    # Phi-3, Phi-3.5, Phi-4-mini: fused qkv and gate_up; partial rotary and LongRoPE from the config
    # (read for every architecture in loader.py). llama.cpp's ffn_up holds the fused gate_up.
    Architecture("phi3", ("Phi3ForCausalLM",), ("phi3",), "phi3", fused_qkv=True, fused_gate_up=True,
                 gguf_tensors={"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}),
    Architecture("smollm3", ("SmolLM3ForCausalLM",), ("smollm3",), "smollm3", gguf_rotary_permuted=True,
                 hf_config=_smollm3_hf, gguf_config=_smollm3_gguf),
    Architecture("granite", ("GraniteForCausalLM",), ("granite",), "granite", gguf_rotary_permuted=True,
                 hf_config=_granite_hf, gguf_config=_granite_gguf),
    Architecture("gemma2", ("Gemma2ForCausalLM",), ("gemma2",), "gemma2", qkv_bias=False,
                 gguf_tensors=GEMMA_GGUF_TENSORS, hf_config=lambda c: _gemma_hf(c, 2),
                 gguf_config=lambda m: _gemma_gguf(m, 2, 46)),
    # Gemma 3's text model (the multimodal checkpoints' language model is the same decoder).
    Architecture("gemma3", ("Gemma3ForCausalLM",), ("gemma3_text",), "gemma3", qkv_bias=False, qk_norm=True,
                 gguf_tensors=GEMMA_GGUF_TENSORS, hf_config=lambda c: {**_gemma_hf(c, 6), **_gemma3_rope(c)},
                 gguf_config=lambda m: {**_gemma_gguf(m, 6, 62), "local_rope_theta": 10_000.0}),
]


def by_hf_name(name: str) -> Architecture | None:
    """The architecture of an HF `architectures` entry or `model_type`."""
    for a in ARCHITECTURES:
        if name in a.hf_architectures or name in a.model_types:
            return a
    return None


def by_gguf_name(name: str) -> Architecture | None:
    for a in ARCHITECTURES:
        if a.gguf_architecture == name:
            return a
    return None


def hf_architecture_names() -> tuple[str, ...]:
    return tuple(n for a in ARCHITECTURES for n in a.hf_architectures)


def gguf_architecture_names() -> tuple[str, ...]:
    return tuple(a.gguf_architecture for a in ARCHITECTURES if a.gguf_architecture)


def gguf_layer_tensors(arch: Architecture) -> dict[str, str]:
    return GGUF_LAYER_TENSORS | arch.gguf_tensors


def gguf_rope_scaling(m: Metadata) -> dict | None:
    """A GGUF file's RoPE scaling as a config's rope_scaling (models/layers.py rope_inv_freq):
    llama.cpp writes Llama 3's as a rope_freqs tensor (each frequency's divisor), LongRoPE's as
    rope_factors_long / _short tensors, linear as metadata."""
    freqs = m.tensor("rope_freqs.weight")
    if freqs is not None:
        return {"rope_type": "freq_factors", "factors": freqs}
    long = m.tensor("rope_factors_long.weight")
    if long is not None:
        return longrope(long, m.tensor("rope_factors_short.weight"), m.get("rope.scaling.original_context_length"),
                        m.get("context_length"), attention_factor=m.get("rope.scaling.attn_factor"))
    kind = m.get("rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": m.get("rope.scaling.factor")}
    if kind == "yarn":
        # llama.cpp's converter writes a config's factor, original context, betas and attention
        # factor where it has them; gpt-oss's config (the converter writes no `truncate`) ramps
        # over fractional dimensions (truncate False), every other config truncates.
        return yarn({"factor": m.get("rope.scaling.factor"), "beta_fast": m.get("rope.scaling.yarn_beta_fast"),
                     "beta_slow": m.get("rope.scaling.yarn_beta_slow"),
                     "attention_factor": m.get("rope.scaling.yarn_attn_factor"),
                     "original_max_position_embeddings": m.get("rope.scaling.original_context_length"),
                     "truncate": m.prefix != "gpt-oss."}, m.get("context_length", 2048))
    raise ValueError(f"GGUF {m.prefix}rope.scaling.type {kind!r} is not supported (supported: linear, yarn, "
                     f"Llama 3's rope_freqs, LongRoPE's rope_factors)")


def yarn(scaling: dict, max_positions: int, config_original: int | None = None) -> dict:
    """YaRN's rope_scaling with transformers' defaults resolved: original_max_position_embeddings
    (a config's own top-level one first, as transformers gives it priority; else max_positions),
    factor (None: the context's growth over the original), attention_factor (None: 0.1 ln(factor) + 1, or with
    mscale and mscale_all_dim their ratio), beta_fast 32, beta_slow 1, truncate True."""
    import math

    def mscale(factor: float, m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    original = config_original or scaling.get("original_max_position_embeddings") or max_positions
    factor = scaling.get("factor") or max_positions / original
    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    return {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": int(original),
            "attention_factor": float(attention), "beta_fast": float(scaling.get("beta_fast") or 32),
            "beta_slow": float(scaling.get("beta_slow") or 1), "truncate": bool(scaling.get("truncate", True))}


def longrope(long_factor: list[float], short_factor: list[float], original: int, max_positions: int,
             factor: float | None = None, attention_factor: float | None = None) -> dict:
    """LongRoPE's rope_scaling with its attention factor resolved as transformers does (from the
    context's growth over the original, unless given): models/layers.py uses the short factors
    for a sequence up to `original` tokens and the long ones past it."""
    import math
    if attention_factor is None:
        factor = factor or max_positions / original
        attention_factor = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
    return {"rope_type": "longrope", "long_factor": list(long_factor), "short_factor": list(short_factor),
            "original_max_position_embeddings": int(original), "attention_factor": float(attention_factor)}
