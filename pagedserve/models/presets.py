"""Model shapes by name, config only: HF-style config dicts of well-known models, for
`load_format="dummy"` runs (random weights of the right shapes; nothing to download).

    LLM("llama-3-8b", load_format="dummy")

A name here stands for its config.json (loader.read_hf_config resolves it), unless a file
or directory of that name exists: a path always wins.
"""
from __future__ import annotations

import os

_LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", torch_dtype="bfloat16",
              bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)

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
}


def is_preset(name: str | None) -> bool:
    return name in PRESETS and not os.path.exists(name)
