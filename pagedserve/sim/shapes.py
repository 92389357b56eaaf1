"""A model's shape, from its HF-style config alone: what the step-time cost model needs
(weights, FLOPs per token, KV bytes per token)."""
from __future__ import annotations

from dataclasses import dataclass

from pagedserve.models.presets import PRESETS

DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
# An 8-bit KV cache's bytes per (token, head) row beyond its head_dim codes: the bf16 scale of
# the scaled formats (attention/kv_format.py); None: "auto", the model's dtype.
KV_ROW_EXTRA_BYTES = {"auto": None, "fp8": 2, "fp8_e4m3": 2, "int8": 2, "fp8_e5m2": 0}


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_size: int
    gated_mlp: bool            # three MLP matrices (Llama's gate, up, down) rather than two (OPT's fc1, fc2)
    vocab_size: int
    tied_embeddings: bool
    dtype_bytes: int = 2
    kv_cache_dtype: str = "auto"     # the KV cache's storage (EngineConfig.kv_cache_dtype)

    @classmethod
    def from_config(cls, config: dict, name: str = "", dtype: str | None = None,
                    kv_cache_dtype: str = "auto") -> "ModelShape":
        heads = config["num_attention_heads"]
        hidden = config["hidden_size"]
        dtype = dtype or config.get("torch_dtype") or "float16"
        return cls(name=name or config.get("_name_or_path", config.get("model_type", "model")),
                   num_layers=config["num_hidden_layers"], hidden_size=hidden, num_heads=heads,
                   num_kv_heads=config.get("num_key_value_heads") or heads,
                   head_dim=config.get("head_dim") or hidden // heads,
                   ffn_size=config.get("intermediate_size") or config["ffn_dim"],
                   gated_mlp="intermediate_size" in config, vocab_size=config["vocab_size"],
                   tied_embeddings=config.get("tie_word_embeddings", True), dtype_bytes=DTYPE_BYTES[dtype],
                   kv_cache_dtype=kv_cache_dtype)

    @classmethod
    def preset(cls, name: str, dtype: str | None = None, kv_cache_dtype: str = "auto") -> "ModelShape":
        if name not in PRESETS:
            raise ValueError(f"model preset must be one of {', '.join(PRESETS)}; got {name!r}")
        return cls.from_config(PRESETS[name], name, dtype, kv_cache_dtype)

    @property
    def layer_params(self) -> int:
        """Weights of one layer's matrix multiplies (Q, K, V, O and the MLP)."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return h * q + 2 * h * kv + q * h + (3 if self.gated_mlp else 2) * h * self.ffn_size

    @property
    def matrices(self) -> list[tuple[int, int]]:
        """One layer's matrix multiplies as the engine runs them, (out_features, in_features):
        Q, K and V fused, the output projection, the MLP's first matrix (gate and up fused
        where it is gated) and its second."""
        h, q, kv, f = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.ffn_size
        return [(q + 2 * kv, h), (h, q), ((2 if self.gated_mlp else 1) * f, h), (h, f)]

    @property
    def head_params(self) -> int:
        return self.hidden_size * self.vocab_size

    @property
    def weight_bytes(self) -> int:
        """All weights (norms, biases and positions are < 0.1% and left out)."""
        embeddings = self.head_params * (1 if self.tied_embeddings else 2)
        return (self.num_layers * self.layer_params + embeddings) * self.dtype_bytes

    @property
    def kv_bytes_per_token_layer(self) -> int:
        extra = KV_ROW_EXTRA_BYTES[self.kv_cache_dtype]
        row = self.head_dim * self.dtype_bytes if extra is None else self.head_dim + extra
        return 2 * self.num_kv_heads * row

    @property
    def kv_bytes_per_token(self) -> int:
        return self.num_layers * self.kv_bytes_per_token_layer
