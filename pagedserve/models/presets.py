"""Model shapes by configuration only (no weights): HF-style config dicts, as the models'
config.json files give them, for the step-time simulator (pagedserve/sim) and for building
random models of a known architecture. PRESETS: name -> config dict."""
from __future__ import annotations

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
