"""OPT (Meta's Open Pre-trained Transformers, the vLLM paper's models) over a flat, unpadded batch.

What differs from the Llama family: learned absolute position embeddings, indexed at the
token's position + 2 (OPT's offset, kept from fairseq); LayerNorm with bias instead of
RMSNorm; a ReLU MLP (fc1, fc2) instead of a gated SiLU one; biases on every projection;
pre-LayerNorm blocks with a final LayerNorm (post-LayerNorm for OPT-350m, whose
`do_layer_norm_before` is false); an optional projection between a smaller word-embedding
width and the hidden size (OPT-350m); the LM head tied to the embeddings unless the
checkpoint has its own. Attention goes through the same paged attention backend as Llama.
The dense ops are plain torch (no packed weights or compiled layer loop for OPT yet).
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from pagedserve.attention.backend import AttentionBackend
from pagedserve.attention.metadata import AttentionMetadata

OPT_ARCHITECTURES = ("OPTForCausalLM",)
POSITION_OFFSET = 2     # OPT's learned position table starts two rows in


@dataclass
class OPTArgs:
    architecture: str
    vocab_size: int
    hidden_size: int
    ffn_dim: int
    num_layers: int
    num_heads: int
    word_embed_proj_dim: int
    max_position_embeddings: int
    do_layer_norm_before: bool
    enable_bias: bool
    activation: str
    tie_word_embeddings: bool
    layer_norm_eps: float = 1e-5
    sliding_window: int | None = None     # (the engine asks every model)

    @property
    def num_kv_heads(self) -> int:
        return self.num_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "OPTArgs":
        act = cfg.get("activation_function", "relu")
        if act not in _ACTIVATIONS:
            raise ValueError(f"unsupported OPT activation_function {act!r}; supported: {', '.join(_ACTIVATIONS)}")
        return cls(architecture="OPTForCausalLM", vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"],
                   ffn_dim=cfg["ffn_dim"], num_layers=cfg["num_hidden_layers"], num_heads=cfg["num_attention_heads"],
                   word_embed_proj_dim=cfg.get("word_embed_proj_dim") or cfg["hidden_size"],
                   max_position_embeddings=cfg.get("max_position_embeddings", 2048),
                   do_layer_norm_before=cfg.get("do_layer_norm_before", True), enable_bias=cfg.get("enable_bias", True),
                   activation=act, tie_word_embeddings=cfg.get("tie_word_embeddings", True))


_ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu}


@dataclass
class OPTLayerWeights:
    attn_norm: tuple[torch.Tensor, torch.Tensor]      # LayerNorm (weight, bias) before/after attention
    qkv: torch.Tensor                                  # [3 * hidden, hidden]
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    mlp_norm: tuple[torch.Tensor, torch.Tensor]
    fc1: torch.Tensor
    fc1_bias: torch.Tensor | None
    fc2: torch.Tensor
    fc2_bias: torch.Tensor | None


class OPTModel:
    def __init__(self, args: OPTArgs, embed: torch.Tensor, positions: torch.Tensor, layers: list[OPTLayerWeights],
                 final_norm: tuple[torch.Tensor, torch.Tensor] | None, lm_head: torch.Tensor,
                 project_in: torch.Tensor | None, project_out: torch.Tensor | None,
                 attention: AttentionBackend) -> None:
        self.args = args
        self.embed, self.positions, self.layers = embed, positions, layers
        self.final_norm, self.lm_head = final_norm, lm_head
        self.project_in, self.project_out = project_in, project_out
        self.attention = attention
        self.scale = args.head_dim ** -0.5
        self.act = _ACTIVATIONS[args.activation]
        self.compiled_layers = None

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    def to(self, device: torch.device) -> "OPTModel":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        tied = self.lm_head is self.embed
        self.embed, self.positions = move(self.embed), move(self.positions)
        self.lm_head = self.embed if tied else move(self.lm_head)
        self.project_in, self.project_out = move(self.project_in), move(self.project_out)
        self.final_norm = None if self.final_norm is None else tuple(move(t) for t in self.final_norm)
        for w in self.layers:
            for f in fields(w):
                t = getattr(w, f.name)
                setattr(w, f.name, tuple(move(x) for x in t) if isinstance(t, tuple) else move(t))
        return self

    def pack_linear_weights(self) -> "OPTModel":
        return self     # plain torch weights

    def _norm(self, x: torch.Tensor, wb: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), wb[0], wb[1], self.args.layer_norm_eps)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T]. Returns the final hidden states [T, hidden]."""
        a = self.args
        T, H, D = input_ids.shape[0], a.num_heads, a.head_dim
        self.attention.prepare(meta)
        x = F.embedding(input_ids, self.embed)
        if self.project_in is not None:
            x = F.linear(x, self.project_in)
        x = x + F.embedding(positions + POSITION_OFFSET, self.positions)
        pre = a.do_layer_norm_before
        for i, w in enumerate(self.layers):
            h = self._norm(x, w.attn_norm) if pre else x
            qkv = F.linear(h, w.qkv, w.qkv_bias)
            q, k, v = (t.reshape(T, H, D) for t in qkv.split(a.hidden_size, dim=-1))
            attn = self.attention.forward(q, k, v, kv_caches[i], meta, self.scale)
            x = x + F.linear(attn.reshape(T, a.hidden_size), w.o, w.o_bias)
            if not pre:
                x = self._norm(x, w.attn_norm)
            h = self._norm(x, w.mlp_norm) if pre else x
            x = x + F.linear(self.act(F.linear(h, w.fc1, w.fc1_bias)), w.fc2, w.fc2_bias)
            if not pre:
                x = self._norm(x, w.mlp_norm)
        if self.final_norm is not None:
            x = self._norm(x, self.final_norm)
        if self.project_out is not None:
            x = F.linear(x, self.project_out)
        return x

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor, decode: bool = False, invariant: bool = False) -> torch.Tensor:
        return F.linear(hidden, self.lm_head).float()


def build_opt_model(args: OPTArgs, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                    attention: AttentionBackend) -> OPTModel:
    """From an HF checkpoint's tensors ("model." already stripped: decoder.layers.0...)."""
    def w(name: str) -> torch.Tensor:
        if name not in weights:
            raise KeyError(f"checkpoint has no tensor {name!r}")
        return weights[name].to(dtype).contiguous()

    def opt(name: str) -> torch.Tensor | None:
        return w(name) if name in weights else None

    def norm(prefix: str) -> tuple[torch.Tensor, torch.Tensor]:
        return w(prefix + ".weight"), w(prefix + ".bias")

    bias = args.enable_bias
    layers = []
    for i in range(args.num_layers):
        p = f"decoder.layers.{i}."
        layers.append(OPTLayerWeights(
            attn_norm=norm(p + "self_attn_layer_norm"),
            qkv=torch.cat([w(p + f"self_attn.{n}_proj.weight") for n in "qkv"]),
            qkv_bias=torch.cat([w(p + f"self_attn.{n}_proj.bias") for n in "qkv"]) if bias else None,
            o=w(p + "self_attn.out_proj.weight"), o_bias=w(p + "self_attn.out_proj.bias") if bias else None,
            mlp_norm=norm(p + "final_layer_norm"),
            fc1=w(p + "fc1.weight"), fc1_bias=w(p + "fc1.bias") if bias else None,
            fc2=w(p + "fc2.weight"), fc2_bias=w(p + "fc2.bias") if bias else None))
    embed = w("decoder.embed_tokens.weight")
    lm_head = embed if args.tie_word_embeddings or "lm_head.weight" not in weights else w("lm_head.weight")
    final_norm = norm("decoder.final_layer_norm") if "decoder.final_layer_norm.weight" in weights else None
    return OPTModel(args, embed, w("decoder.embed_positions.weight"), layers, final_norm, lm_head,
                    opt("decoder.project_in.weight"), opt("decoder.project_out.weight"), attention)
