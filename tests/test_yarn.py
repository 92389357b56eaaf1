"""YaRN RoPE (rope_type "yarn": gpt-oss, Qwen3's long-context configs): the inverse frequencies and
the attention factor equal transformers' own (its ROPE_INIT_FUNCTIONS["yarn"]) bit for bit, for
each of its options; the models that use it (tests/conftest.py's qwen3_yarn, test_models.py and
test_architectures.py; gpt-oss in test_moe_models.py and test_gpt_oss_gguf.py) generate
transformers' tokens."""
from __future__ import annotations

import pytest
import torch

from pagedserve.models import architectures
from pagedserve.models.layers import RotaryEmbedding, rope_inv_freq
from pagedserve.models.loader import args_from_hf_config

transformers = pytest.importorskip("transformers")

CASES = {
    "qwen3_long": dict(factor=4.0, original_max_position_embeddings=32768),
    "gpt_oss": dict(factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False, original_max_position_embeddings=4096),
    "narrow_ramp": dict(factor=8.0, beta_fast=8.0, beta_slow=2.0, original_max_position_embeddings=64),
    "mscale_ratio": dict(factor=40.0, mscale=1.0, mscale_all_dim=0.707, original_max_position_embeddings=4096),
    "attention_factor_given": dict(factor=2.0, attention_factor=0.9, original_max_position_embeddings=256),
}


def _config(params: dict, head_dim: int, theta: float, partial: float = 1.0):
    return transformers.Qwen3Config(
        hidden_size=64, num_attention_heads=4, head_dim=head_dim, max_position_embeddings=1024,
        rope_parameters={"rope_type": "yarn", "rope_theta": theta, "partial_rotary_factor": partial,
                         **{k: v for k, v in params.items() if v is not None}})


@pytest.mark.parametrize("head_dim, theta", [(64, 150000.0), (16, 10000.0), (128, 1000000.0)])
@pytest.mark.parametrize("case", sorted(CASES))
def test_inv_freq_and_attention_factor_equal_transformers(case, head_dim, theta):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    cfg = _config(CASES[case], head_dim, theta)
    ref_freq, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](cfg)
    args = args_from_hf_config({**cfg.to_dict(), "architectures": ["Qwen3ForCausalLM"]})
    assert args.rope_scaling["rope_type"] == "yarn"
    assert torch.equal(rope_inv_freq(head_dim, theta, args.rope_scaling), ref_freq)
    assert args.rope_scaling["attention_factor"] == pytest.approx(ref_factor, rel=1e-12)
    # cos / sin carry the factor, as transformers' rotary embedding multiplies them
    rope = RotaryEmbedding(head_dim, 8, theta, args.rope_scaling, torch.float32)
    freqs = torch.outer(torch.arange(8, dtype=torch.float32), ref_freq)
    assert torch.allclose(rope.cos[:, :head_dim // 2], freqs.cos() * ref_factor, atol=1e-6)


def test_a_transformers_4_config_and_the_original_length_outside_the_scaling():
    """rope_scaling with `type` (transformers 4), and the original length at the config's top
    level, which transformers prefers to the one inside."""
    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 64, "intermediate_size": 64,
           "num_hidden_layers": 1, "num_attention_heads": 4, "max_position_embeddings": 4096,
           "original_max_position_embeddings": 512, "rope_theta": 10000.0,
           "rope_scaling": {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 2048}}
    args = args_from_hf_config(cfg)
    assert args.rope_scaling["original_max_position_embeddings"] == 512
    assert args.rope_scaling["truncate"] is True and args.rope_scaling["beta_fast"] == 32.0


def test_gguf_yarn_keys_are_read_with_gpt_oss_untruncated():
    class Field:
        def __init__(self, v):
            self.v = v

        def contents(self):
            return self.v

    class Reader:
        def __init__(self, arch):
            self.tensors = []
            self.fields = {f"{arch}.{k}": Field(v) for k, v in {
                "rope.scaling.type": "yarn", "rope.scaling.factor": 32.0, "rope.scaling.original_context_length": 4096,
                "rope.scaling.yarn_beta_fast": 32.0, "rope.scaling.yarn_beta_slow": 1.0, "context_length": 131072}.items()}

    for arch, truncate in (("gpt-oss", False), ("qwen3", True)):
        s = architectures.gguf_rope_scaling(architectures.Metadata(Reader(arch), arch))
        assert s["truncate"] is truncate and s["factor"] == 32.0 and s["original_max_position_embeddings"] == 4096
        assert s["attention_factor"] == pytest.approx(0.1 * torch.log(torch.tensor(32.0)).item() + 1)
