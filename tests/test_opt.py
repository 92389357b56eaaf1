"""OPT (the vLLM paper's models) against transformers' OPTForCausalLM on tiny random configs,
in float32: logits over a prefill, chunked prefill and token-by-token decode through a
shuffled block table, and greedy tokens from the engine."""
import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.attention.torch_backend import TorchAttention
from pagedserve.models.loader import load_model
from pagedserve.models.opt import OPTModel
from tests.conftest import PROMPTS, hf_greedy
from tests.test_models import paged_logits

OPT_VARIANTS = {
    # OPT-13B/66B/175B's form: pre-LayerNorm, final LayerNorm, tied head.
    "opt_pre_ln_tied": dict(do_layer_norm_before=True, word_embed_proj_dim=64, tie_word_embeddings=True),
    # OPT-350m's form: post-LayerNorm, a narrower word embedding projected in and out; here untied.
    "opt_post_ln_projected_untied": dict(do_layer_norm_before=False, word_embed_proj_dim=32,
                                         tie_word_embeddings=False),
}
_built: dict = {}


@pytest.fixture
def tiny_opt(tiny_root, tiny_tokenizer):
    def get(name: str):
        if name not in _built:
            import transformers
            tok = tiny_tokenizer
            config = transformers.OPTConfig(
                vocab_size=len(tok), hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=256, dropout=0.0, attention_dropout=0.0, activation_function="relu",
                init_std=0.1, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                pad_token_id=tok.eos_token_id, **OPT_VARIANTS[name])
            torch.manual_seed(7)
            hf = transformers.OPTForCausalLM(config).float().eval()
            with torch.no_grad():   # random LayerNorm affines and biases, so that mixing them up shows
                for n, p in hf.named_parameters():
                    if "layer_norm" in n or n.endswith(".bias"):
                        p.normal_(1.0 if n.endswith("weight") else 0.0, 0.2)
            path = tiny_root / name
            hf.save_pretrained(path)
            tok.save_pretrained(path)
            _built[name] = (str(path), hf, tok)
        return _built[name]
    return get


@pytest.mark.parametrize("name", sorted(OPT_VARIANTS))
def test_opt_logits_match_transformers(tiny_opt, name):
    path, hf, tok = tiny_opt(name)
    model, args, _ = load_model(path, "float32", TorchAttention())
    assert isinstance(model, OPTModel)
    assert (model.lm_head is model.embed) == OPT_VARIANTS[name]["tie_word_embeddings"]
    prompt = tok.encode(PROMPTS[5])
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    for chunk in (len(prompt), 5, 1):
        torch.testing.assert_close(paged_logits(model, prompt, chunk), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", sorted(OPT_VARIANTS))
def test_opt_greedy_tokens_match_transformers_generate(tiny_opt, name):
    path, hf, tok = tiny_opt(name)
    llm = LLM(path, dtype="float32", num_gpu_blocks_override=64, block_size=16)
    prompts = [tok.encode(p) for p in PROMPTS[:3]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12))
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf, p, 12)
