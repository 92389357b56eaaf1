"""The real default model (SmolLM2-135M-Instruct, GGUF) against transformers' own GGUF loading."""
from pathlib import Path

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.engine.llm import render_chat
from pagedserve.models.loader import default_model_path
from tests.beam_reference import check_beam_search
from tests.test_quantized_models import DEFAULT_MODEL_MARGIN

PROMPTS = [
    "The capital of France is",
    "Here is a short poem about the sea:",
    "def fibonacci(n):",
    "The three primary colors are",
    "Once upon a time, in a small village,",
    "To make a cup of tea, first",
    "The largest planet in the solar system is",
    "Water boils at",
    "My favourite book is",
    "In 1969, humans",
]


@pytest.fixture(scope="module")
def default_path():
    try:
        return default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def hf_model(default_path):
    from transformers import AutoModelForCausalLM
    p = Path(default_path)
    return AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(default_path):
    # The dequantized path: token for token against transformers' own dequantized float32 (the
    # native Q4_1 blocks, with 8-bit activations, are checked in tests/test_quantized_models.py).
    return LLM(dtype="float32", kv_cache_memory=256 * 1024**2, gguf_dequantize=True)


def test_default_model_greedy_matches_transformers(llm, hf_model):
    tok = llm.get_tokenizer()
    chat = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
            for q in ("What is 2+2?", "Name a fruit.")]
    prompts = PROMPTS + chat
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, min_tokens=32), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ids = out.prompt_token_ids
        assert ids == tok.encode(prompt)
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                                    pad_token_id=tok.eos_token_id)[0, len(ids):].tolist()
        assert out.outputs[0].token_ids == ref, prompt
    assert llm.kv_cache_stats()["num_used_blocks"] == 0


def test_default_model_answers_sensibly(llm):
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text
    chat = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                    SamplingParams(temperature=0, max_tokens=30), use_tqdm=False)
    assert "Paris" in chat[0].outputs[0].text
    assert chat[0].outputs[0].finish_reason in ("stop", "length")


def test_default_model_beam_search_equals_the_textbook_definition(llm, hf_model):
    """Token for token against the reference definition over transformers' forward, on chat
    prompts (whose answers end in EOS within a few tokens) and plain ones. Prompts of equal
    length let the reference batch them."""
    tok = llm.get_tokenizer()
    questions = ("Name a fruit.", "Name a planet.", "Count to three.", "Is ice cold?")   # 34 tokens each
    prompts = [render_chat(tok, [{"role": "user", "content": q}]) for q in questions]
    prompts += [tok.encode(p) for p in ("The capital of France is", "The three primary colors are")]   # 5 each
    seen = check_beam_search(llm, hf_model, prompts, tok.eos_token_id, max_tokens=16, num_threads=None)
    assert any(h[-1] == tok.eos_token_id for h in seen)     # finished hypotheses were ranked
    assert llm.kv_cache_stats()["num_used_blocks"] == 0


def test_default_model_tensor_parallel_3_matches_transformers(default_path, hf_model):
    """9 query heads and 3 KV heads over 3 ranks (one KV head each; tests/test_tensor_parallel.py
    has the rest of tensor parallelism), greedy in float32. The file's blocks compute with 8-bit
    activations, so a token may differ from transformers' (on the dequantized weights) only at a
    near-tie, as in tests/test_quantized_models.py (seen: 0.066 apart in logprob)."""
    tp = LLM(dtype="float32", kv_cache_memory=64 * 1024**2, tensor_parallel_size=3)
    try:
        outs = tp.generate(PROMPTS[:3], SamplingParams(temperature=0, max_tokens=16, min_tokens=16), use_tqdm=False)
    finally:
        tp.shutdown()
    for out in outs:
        ids = out.prompt_token_ids
        got = list(out.outputs[0].token_ids)
        with torch.no_grad():
            ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=16, min_new_tokens=16, do_sample=False,
                                    pad_token_id=tp.get_tokenizer().eos_token_id)[0, len(ids):].tolist()
            if got != ref:
                i = next(k for k, (a, b) in enumerate(zip(got, ref)) if a != b)
                lp = hf_model(torch.tensor([ids + ref[:i]])).logits[0, -1].log_softmax(-1)
                assert lp[ref[i]] - lp[got[i]] <= DEFAULT_MODEL_MARGIN, (out.prompt, i)

