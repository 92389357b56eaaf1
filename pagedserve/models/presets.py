"""Model shapes by name, config only: HF-style config dicts of well-known models, for
`load_format="dummy"` runs (random weights of the right shapes; nothing to download) and for
the step-time simulator (pagedserve/sim).

    LLM("llama-3-8b", load_format="dummy")

A name here stands for its config.json (loader.read_hf_config resolves it), unless a file
or directory of that name exists: a path always wins.
"""
from __future__ import annotations

import os

_LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", torch_dtype="bfloat16",
              bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)

_OPT_COMMON = {
    "architectures": ["OPTForCausalLM"], "model_type": "opt", "activation_function": "relu",
    "do_layer_norm_before": True, "enable_bias": True, "layer_norm_elementwise_affine": True,
    "max_position_embeddings": 2048, "vocab_size": 50272, "bos_token_id": 2, "eos_token_id": 2,
    "pad_token_id": 1, "tie_word_embeddings": True, "torch_dtype": "float16",
}


def _opt(hidden: int, layers: int, heads: int) -> dict:
    """facebook/opt-*: the FFN is 4x the hidden size, the embeddings are tied."""
    return {**_OPT_COMMON, "hidden_size": hidden, "word_embed_proj_dim": hidden, "num_hidden_layers": layers,
            "num_attention_heads": heads, "ffn_dim": 4 * hidden}


PRESETS: dict[str, dict] = {
    # name: HF config.json contents (the fields the loader reads)
    "smollm2-135m": _LLAMA | dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                  num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                                  max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
                                  tie_word_embeddings=True, bos_token_id=1, eos_token_id=2),
    "tinyllama-1.1b": _LLAMA | dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                                    num_attention_heads=32, num_key_value_heads=4, vocab_size=32000,
                                    max_position_embeddings=2048, rms_norm_eps=1e-5, rope_theta=10000.0),
    "llama-2-7b": _LLAMA | dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                num_attention_heads=32, num_key_value_heads=32, vocab_size=32000,
                                max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0),
    "llama-2-13b": _LLAMA | dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
                                 num_attention_heads=40, num_key_value_heads=40, vocab_size=32000,
                                 max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0),
    "llama-3-8b": _LLAMA | dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
                                bos_token_id=128000, eos_token_id=128001),
    "llama-3.1-8b": _LLAMA | dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                  num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                  max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                                  rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                    high_freq_factor=4.0, original_max_position_embeddings=8192),
                                  bos_token_id=128000, eos_token_id=128001),
    "mistral-7b": dict(architectures=["MistralForCausalLM"], model_type="mistral", torch_dtype="bfloat16",
                       hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=32768, max_position_embeddings=32768, rms_norm_eps=1e-5,
                       rope_theta=1000000.0, sliding_window=None, tie_word_embeddings=False,
                       bos_token_id=1, eos_token_id=2),
    "qwen2-7b": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", torch_dtype="bfloat16",
                     hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                     num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768, rms_norm_eps=1e-6,
                     rope_theta=1000000.0, use_sliding_window=False, tie_word_embeddings=False,
                     bos_token_id=151643, eos_token_id=151643),
    # The vLLM paper's models (Kwon et al., SOSP 2023, Table 1), from facebook/opt-*'s config.json.
    "opt-13b": _opt(5120, 40, 40),
    "opt-66b": _opt(9216, 64, 72),
    # OPT-175B's weights were released on request only; its shape is in the OPT paper (Table 1).
    "opt-175b": _opt(12288, 96, 96),
    # LLaMA-13B (the paper's Fig. 16-17 use LLaMA-13B too), from the original release's config.
    "llama-13b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 40, "num_attention_heads": 40,
        "num_key_value_heads": 40, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "vocab_size": 32000,
        "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False, "torch_dtype": "float16",
    },
}


def is_preset(name: str | None) -> bool:
    return name in PRESETS and not os.path.exists(name)
