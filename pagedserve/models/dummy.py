"""`load_format="dummy"`: random weights of a model's shapes, made on the device, and a
stand-in tokenizer when the model has none (a preset name is a config only).

For timing runs of models whose weights are not here. The weights are drawn when the
model builder asks for each tensor, one at a time, so loading never holds more than the
model plus one layer's unfused matrices. Values are those of a freshly initialised model
(normal, std 0.02; norms 1), which keeps activations finite; the text means nothing.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from pagedserve.models import architectures
from pagedserve.models.llama import ModelArgs
from pagedserve.models.moe_weights import expert_names, hf_moe_shapes

INIT_STD = 0.02


def weight_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every tensor of a Llama-family checkpoint, by its HF name (without `model.`)."""
    h, d, i = args.hidden_size, args.head_dim, args.intermediate_size
    q, kv = args.num_heads * d, args.num_kv_heads * d
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (args.vocab_size, h), "norm.weight": (h,)}
    if not args.tie_word_embeddings:
        shapes["lm_head.weight"] = (args.vocab_size, h)
    arch = architectures.by_hf_name(args.architecture)
    whole = {"q": (0, q), "k": (0, kv), "v": (0, kv)}
    for layer in range(args.num_layers):
        p = f"layers.{layer}."
        shapes |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                   p + "self_attn.o_proj.weight": (h, q)}
        mlp = []
        if args.moe is not None and args.moe.is_sparse(layer):     # a router and experts in the MLP's place
            shapes |= hf_moe_shapes(p, args.moe, h, expert_names(args.architecture))
        else:
            shapes[p + "mlp.down_proj.weight"] = (h, i)
            mlp = [(arch.gate_up_parts(p, None, i), (h,))]
        # (the checkpoint's own tensors: q/k/v or a fused qkv_proj, gate/up or gate_up_proj)
        for parts, cols in [(arch.qkv_parts(p, whole, q, kv), (h,)), *mlp]:
            for name, _ in parts:
                shapes[name] = (sum(r[1] - r[0] if r else i for n, r in parts if n == name), *cols)
        if args.qk_norm:       # per head, or (qk_norm_full) over all of q and of k
            qn, kn = (q, kv) if args.qk_norm_full else (d, d)
            shapes |= {p + "self_attn.q_norm.weight": (qn,), p + "self_attn.k_norm.weight": (kn,)}
        if args.sandwich_norms:
            shapes |= {p + "pre_feedforward_layernorm.weight": (h,), p + "post_feedforward_layernorm.weight": (h,)}
        if args.attention_sinks:
            shapes[p + "self_attn.sinks"] = (args.num_heads,)
        if args.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        if args.qkv_bias:
            for name, _ in (parts := arch.qkv_parts(p, whole, q, kv, "bias")):
                shapes[name] = (sum(r[1] - r[0] for n, r in parts if n == name),)
    return shapes


class DummyWeights(Mapping):
    """name -> a random tensor of that weight's shape, drawn on `device` when asked for."""

    def __init__(self, args: ModelArgs, dtype: torch.dtype, device: torch.device | str, seed: int = 0) -> None:
        self.shapes = weight_shapes(args)
        self.norm_offset = args.norm_offset
        self.dtype, self.device = dtype, torch.device(device)
        # (the meta device, which only checks shapes, has no generator)
        self.generator = None if self.device.type == "meta" else torch.Generator(self.device).manual_seed(seed)

    def __getitem__(self, name: str) -> torch.Tensor:
        shape = self.shapes[name]
        if name.endswith("norm.weight"):     # (a (1 + w) norm's w: zeros)
            return torch.full(shape, 1.0 - self.norm_offset, dtype=self.dtype, device=self.device)
        t = torch.empty(shape, dtype=self.dtype, device=self.device)
        return t.normal_(0.0, INIT_STD, generator=self.generator)

    def __contains__(self, name: object) -> bool:
        return name in self.shapes          # (Mapping's default would draw the tensor)

    def __iter__(self) -> Iterator[str]:
        return iter(self.shapes)

    def __len__(self) -> int:
        return len(self.shapes)


def stand_in_tokenizer(config: dict):
    """A tokenizer over the model's vocabulary that knows no text: token i is the word
    `<i>` (prompts as text are such words separated by spaces; outputs decode to them).
    BOS and EOS keep the config's ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {f"<{i}>": i for i in range(config["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()

    def special(key: str) -> str | None:
        value = config.get(key)
        value = value[0] if isinstance(value, list) else value
        return f"<{value}>" if isinstance(value, int) and 0 <= value < config["vocab_size"] else None

    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<0>", bos_token=special("bos_token_id"),
                                   eos_token=special("eos_token_id"))
