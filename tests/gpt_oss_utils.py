"""A tiny random gpt-oss (transformers' GptOssForCausalLM: 4 experts top-2, clamped SwiGLU with
biases, sinks, a sliding-window and a full layer, gpt-oss's YaRN) and its GGUF file as llama.cpp's
converter writes it (experts in MXFP4, stacked per projection), for tests/test_moe_models.py and
tests/test_gpt_oss_gguf.py."""
from __future__ import annotations

import numpy as np
import torch

from tests.gguf_utils import add_tokenizer, finish, hf_writer


def tiny_gpt_oss(tokenizer, root, experts: int = 4):
    import transformers
    cfg = transformers.GptOssConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=experts, num_experts_per_tok=2, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"], max_position_embeddings=512, rms_norm_eps=1e-5,
        # gpt-oss's YaRN (truncate False), its original context shrunk so the ramp spans head_dim 16's frequencies
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "truncate": False, "original_max_position_embeddings": 64}, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
    torch.manual_seed(11)
    hf = transformers.GptOssForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" not in n:
                p.normal_(0, 0.15)
    hf.save_pretrained(root)
    tokenizer.save_pretrained(root)
    return hf


_LAYER = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
          "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
          "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
          "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
          "self_attn.o_proj.weight": "attn_output.weight", "self_attn.o_proj.bias": "attn_output.bias",
          "self_attn.sinks": "attn_sinks.weight", "mlp.router.weight": "ffn_gate_inp.weight",
          "mlp.router.bias": "ffn_gate_inp.bias"}
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}


def write_gpt_oss_gguf(hf, tokenizer, path) -> dict[str, torch.Tensor]:
    """`hf` as llama.cpp writes a `gpt-oss` file: header (expert counts and width, sliding window,
    YaRN's keys as the converter writes a config's), gpt2 tokenizer, attention and routers float32,
    experts MXFP4 (gguf.quants) stacked per projection ([E, rows, cols] in numpy's order: gate and up
    de-interleaved), their biases float32 [E, rows]. Returns the oracle's state dict: the file's
    numbers in transformers' names."""
    import gguf
    cfg = hf.config
    rope = cfg.rope_parameters
    w = hf_writer(path, "gpt-oss", cfg, rope_theta=rope["rope_theta"])
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_expert_count(cfg.num_local_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_feed_forward_length(cfg.intermediate_size)
    w.add_sliding_window(cfg.sliding_window)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    add_tokenizer(w, tokenizer)
    state = {k: v.detach().float() for k, v in hf.state_dict().items()}
    oracle = dict(state)

    def mxfp4(name: str, a: np.ndarray) -> torch.Tensor:
        """[E, rows, cols] in MXFP4 under `name`; the numbers the file holds."""
        e, rows, cols = a.shape
        raw = gguf.quants.quantize(np.ascontiguousarray(a).reshape(e * rows, cols), gguf.GGMLQuantizationType.MXFP4)
        w.add_tensor(name, raw.reshape(e, rows, -1), raw_dtype=gguf.GGMLQuantizationType.MXFP4)
        back = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.MXFP4)
        return torch.from_numpy(np.asarray(back, dtype=np.float32).reshape(e, rows, cols).copy())

    for name, t in state.items():
        a = t.numpy()
        if name in _TOP:
            w.add_tensor(_TOP[name], a)
            continue
        _, _, i, rest = name.split(".", 3)
        if rest == "mlp.experts.gate_up_proj":            # [E, H, 2I], gate and up interleaved by column
            gate = mxfp4(f"blk.{i}.ffn_gate_exps.weight", a[:, :, 0::2].transpose(0, 2, 1))
            up = mxfp4(f"blk.{i}.ffn_up_exps.weight", a[:, :, 1::2].transpose(0, 2, 1))
            both = torch.empty_like(t)
            both[:, :, 0::2], both[:, :, 1::2] = gate.transpose(1, 2), up.transpose(1, 2)
            oracle[name] = both
        elif rest == "mlp.experts.down_proj":             # [E, I, H]
            oracle[name] = mxfp4(f"blk.{i}.ffn_down_exps.weight", a.transpose(0, 2, 1)).transpose(1, 2).contiguous()
        elif rest == "mlp.experts.gate_up_proj_bias":
            w.add_tensor(f"blk.{i}.ffn_gate_exps.bias", np.ascontiguousarray(a[:, 0::2]))
            w.add_tensor(f"blk.{i}.ffn_up_exps.bias", np.ascontiguousarray(a[:, 1::2]))
        elif rest == "mlp.experts.down_proj_bias":
            w.add_tensor(f"blk.{i}.ffn_down_exps.bias", a)
        else:
            w.add_tensor(f"blk.{i}.{_LAYER[rest]}", a)
    finish(w)
    return oracle
