"""Tiny random mixture-of-experts models (transformers' own classes) and their GGUF files as
llama.cpp's converter writes them (experts stacked in one 3-D tensor per projection), for
tests/test_moe_models.py."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tests.gguf_utils import finish, gguf_writer

# name -> (transformers config class, its keyword arguments, GGUF architecture)
MOE_VARIANTS = {
    "mixtral": ("MixtralConfig", dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32), "llama"),
    "olmoe": ("OlmoeConfig", dict(num_experts=8, num_experts_per_tok=2, intermediate_size=32), "olmoe"),
    # layer 0 a dense MLP (mlp_only_layers), layer 1 sparse; renormalised top-k
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                         intermediate_size=64, mlp_only_layers=[0], norm_topk_prob=True,
                                         head_dim=16), "qwen3moe"),
}
_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
          "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
          "block_sparse_moe.gate": "ffn_gate_inp"}
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}


@dataclass
class TinyMoE:
    name: str
    path: str
    hf: object
    tokenizer: object
    gguf_arch: str


def make_tiny_moe(root: Path, name: str, tokenizer) -> TinyMoE:
    import transformers
    cls_name, extra, gguf_arch = MOE_VARIANTS[name]
    cfg = getattr(transformers, cls_name)(
        vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, initializer_range=0.1,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id, tie_word_embeddings=False, **extra)
    torch.manual_seed(7)
    hf = getattr(transformers, cls_name.replace("Config", "ForCausalLM"))(cfg).float().eval()
    with torch.no_grad():          # routers as random as the rest (they start at zero in some classes)
        for n, p in hf.named_parameters():
            if n.endswith("gate.weight") and p.dim() == 2:
                p.normal_(0, 0.3)
    path = root / name
    hf.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return TinyMoE(name, str(path), hf, tokenizer, gguf_arch)


def _permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """HF's q/k rows into llama.cpp's rotary layout (its `llama` converter's)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_moe_gguf(tm: TinyMoE, path, qtype=None) -> dict[str, torch.Tensor]:
    """The model as llama.cpp's converter writes it: experts stacked per projection ([E, rows,
    cols] in numpy's order), routers float32, q/k permuted for `llama` (Mixtral) files; every
    matrix in `qtype` (a gguf.GGMLQuantizationType; None: float32). Returns the oracle's state
    dict: the file's numbers in HF's names."""
    import gguf
    cfg = tm.hf.config
    state = {k: v.detach().float() for k, v in tm.hf.state_dict().items()}
    w = gguf_writer(path, tm.gguf_arch, layers=cfg.num_hidden_layers, context=cfg.max_position_embeddings,
                    hidden=cfg.hidden_size, intermediate=cfg.intermediate_size, heads=cfg.num_attention_heads,
                    kv_heads=cfg.num_key_value_heads, eps=cfg.rms_norm_eps, vocab=cfg.vocab_size,
                    rope_theta=cfg.rope_parameters["rope_theta"])
    experts = getattr(cfg, "num_local_experts", None) or cfg.num_experts
    w.add_expert_count(experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if hasattr(cfg, "moe_intermediate_size"):
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    oracle = dict(state)
    heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}

    def add(name: str, a: np.ndarray, quantize: bool) -> np.ndarray:
        """Write `a` under `name`; the numbers the file holds (float32)."""
        if qtype is None or not quantize:
            w.add_tensor(name, a)
            return a
        raw = gguf.quants.quantize(a, qtype)
        w.add_tensor(name, raw, raw_dtype=qtype)
        return np.asarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32)

    for name, t in state.items():
        a = t.numpy()
        if name in _TOP:
            oracle[name] = torch.from_numpy(add(_TOP[name], a, name == "lm_head.weight").copy())
            continue
        _, _, i, rest = name.split(".", 3)
        if rest == "mlp.experts.gate_up_proj":        # transformers' [E, 2I, H]: llama.cpp's gate and up apart
            inter = a.shape[1] // 2
            gate = add(f"blk.{i}.ffn_gate_exps.weight", np.ascontiguousarray(a[:, :inter]), True)
            up = add(f"blk.{i}.ffn_up_exps.weight", np.ascontiguousarray(a[:, inter:]), True)
            oracle[name] = torch.from_numpy(np.concatenate([gate, up], axis=1))
            continue
        if rest == "mlp.experts.down_proj":
            oracle[name] = torch.from_numpy(add(f"blk.{i}.ffn_down_exps.weight", a, True).copy())
            continue
        module, _ = rest.rsplit(".", 1)
        kind = _LAYER[module]
        permuted = tm.gguf_arch == "llama" and kind in heads
        back = add(f"blk.{i}.{kind}.weight", _permute(a, heads[kind]) if permuted else a,
                   a.ndim == 2 and kind != "ffn_gate_inp")
        oracle[name] = torch.from_numpy((_unpermute(back, heads[kind]) if permuted else back).copy())
    finish(w)
    return oracle


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def oracle_model(tm: TinyMoE, state: dict[str, torch.Tensor]):
    """transformers' model of the same class over `state` (a file's dequantized numbers)."""
    import transformers
    hf = type(tm.hf)(tm.hf.config).float().eval()
    hf.load_state_dict(state)
    return hf


def read_config(tm: TinyMoE) -> dict:
    return json.loads((Path(tm.path) / "config.json").read_text())


def assert_compiled_loop_equals_python_loop(llm, model, prompts: list[str], params, dtype: str) -> None:
    """Greedy outputs with the compiled CPU layer loop, then with it switched off (the Python
    layer loop): the same tokens, and logprobs within dtype's rounding."""
    compiled = llm.generate(prompts, params, use_tqdm=False)
    model.compiled_layers, loop = None, model.compiled_layers
    python = llm.generate(prompts, params, use_tqdm=False)
    model.compiled_layers = loop
    for a, b in zip(compiled, python):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids, a.prompt
        la = torch.tensor([lp[t].logprob for lp, t in zip(a.outputs[0].logprobs, a.outputs[0].token_ids)])
        lb = torch.tensor([lp[t].logprob for lp, t in zip(b.outputs[0].logprobs, b.outputs[0].token_ids)])
        assert (la - lb).abs().max() <= (2e-2 if dtype == "bfloat16" else 1e-3), a.prompt
