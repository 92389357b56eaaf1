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
    # A mixture of experts: `sparse_layers` of the layers have, in the MLP's place, a router and
    # num_experts gated experts of expert_ffn_size, experts_per_token of them run per token.
    num_experts: int = 0
    experts_per_token: int = 0
    expert_ffn_size: int = 0
    sparse_layers: int = 0

    @classmethod
    def from_config(cls, config: dict, name: str = "", dtype: str | None = None,
                    kv_cache_dtype: str = "auto") -> "ModelShape":
        heads = config["num_attention_heads"]
        hidden = config["hidden_size"]
        dtype = dtype or config.get("torch_dtype") or "float16"
        layers = config["num_hidden_layers"]
        experts = config.get("num_experts") or config.get("num_local_experts") or 0
        step, dense = config.get("decoder_sparse_step") or 1, set(config.get("mlp_only_layers") or ())
        moe = dict(num_experts=experts, experts_per_token=config["num_experts_per_tok"],
                   expert_ffn_size=config.get("moe_intermediate_size") or config["intermediate_size"],
                   sparse_layers=sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0)) \
            if experts else {}
        return cls(name=name or config.get("_name_or_path", config.get("model_type", "model")),
                   num_layers=config["num_hidden_layers"], hidden_size=hidden, num_heads=heads,
                   num_kv_heads=config.get("num_key_value_heads") or heads,
                   head_dim=config.get("head_dim") or hidden // heads,
                   ffn_size=config.get("intermediate_size") or config["ffn_dim"],
                   gated_mlp="intermediate_size" in config, vocab_size=config["vocab_size"],
                   tied_embeddings=config.get("tie_word_embeddings", True), dtype_bytes=DTYPE_BYTES[dtype],
                   kv_cache_dtype=kv_cache_dtype, **moe)

    @classmethod
    def preset(cls, name: str, dtype: str | None = None, kv_cache_dtype: str = "auto") -> "ModelShape":
        if name not in PRESETS:
            raise ValueError(f"model preset must be one of {', '.join(PRESETS)}; got {name!r}")
        return cls.from_config(PRESETS[name], name, dtype, kv_cache_dtype)

    @property
    def layer_params(self) -> int:
        """Weights of one dense layer's matrix multiplies (Q, K, V, O and the MLP)."""
        return sum(n * k for n, k in self.matrices)

    @property
    def attention_matrices(self) -> list[tuple[int, int]]:
        """(out_features, in_features) of Q, K and V fused, and of the output projection."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return [(q + 2 * kv, h), (h, q)]

    @property
    def mlp_matrices(self) -> list[tuple[int, int]]:
        """A dense MLP's first matrix (gate and up fused where it is gated) and its second."""
        h, f = self.hidden_size, self.ffn_size
        return [((2 if self.gated_mlp else 1) * f, h), (h, f)]

    @property
    def matrices(self) -> list[tuple[int, int]]:
        """One dense layer's matrix multiplies as the engine runs them."""
        return self.attention_matrices + self.mlp_matrices

    @property
    def expert_matrices(self) -> list[tuple[int, int]]:
        """One expert's gate/up (fused) and down."""
        return [(2 * self.expert_ffn_size, self.hidden_size), (self.hidden_size, self.expert_ffn_size)]

    @property
    def dense_layers(self) -> int:
        return self.num_layers - self.sparse_layers

    def experts_read(self, tokens: int) -> float:
        """Experts of a sparse layer that `tokens` tokens route to, expected under even routing:
        E (1 - (1 - k/E)^T). One token reads k of them; a large batch all E."""
        if not self.num_experts or not tokens:
            return 0.0
        return self.num_experts * (1 - (1 - self.experts_per_token / self.num_experts) ** tokens)

    def _sparse_params(self, experts: float) -> float:
        """A sparse layer's weights when `experts` experts are counted (and its router)."""
        return experts * sum(n * k for n, k in self.expert_matrices) + self.num_experts * self.hidden_size

    @property
    def head_params(self) -> int:
        return self.hidden_size * self.vocab_size

    @property
    def weight_bytes(self) -> int:
        """All weights, every expert's included (norms, biases and positions are < 0.1% and left out)."""
        embeddings = self.head_params * (1 if self.tied_embeddings else 2)
        attention = sum(n * k for n, k in self.attention_matrices)
        layers = self.num_layers * attention + self.dense_layers * sum(n * k for n, k in self.mlp_matrices) + \
            self.sparse_layers * self._sparse_params(self.num_experts)
        return int((layers + embeddings) * self.dtype_bytes)

    def read_bytes(self, tokens: int = 1) -> int:
        """Weight bytes a step of `tokens` tokens reads (each weight once): every dense matrix, of
        a sparse layer its router and the experts the tokens route to (experts_read), the LM head."""
        attention = sum(n * k for n, k in self.attention_matrices)
        layers = self.num_layers * attention + self.dense_layers * sum(n * k for n, k in self.mlp_matrices) + \
            self.sparse_layers * self._sparse_params(self.experts_read(tokens))
        return int((layers + self.head_params) * self.dtype_bytes)

    @property
    def kv_bytes_per_token_layer(self) -> int:
        extra = KV_ROW_EXTRA_BYTES[self.kv_cache_dtype]
        row = self.head_dim * self.dtype_bytes if extra is None else self.head_dim + extra
        return 2 * self.num_kv_heads * row

    @property
    def kv_bytes_per_token(self) -> int:
        return self.num_layers * self.kv_bytes_per_token_layer
