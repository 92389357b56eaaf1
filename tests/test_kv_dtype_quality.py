"""Greedy decoding over an 8-bit KV cache keeps transformers' float32 tokens wherever the oracle's
own top token leads by a clear margin, and the check can fail: the same engine with every row's
scale dropped after it is written (the codes read as the values) parts from the oracle where it
is sure."""
import pytest
import torch

from pagedserve import SamplingParams
from pagedserve.kernels import cpu
from tests.conftest import PROMPTS, hf_greedy
from tests.test_engine import make_llm

TOKENS = 12
# A parting counts only where the oracle's token leads ours by more than this (logits): the tiny
# random model's logits nearly tie in places, where any rounding may flip the argmax.
MARGIN = 0.5


@pytest.fixture(scope="module")
def head64(tiny_models):
    return tiny_models("llama_head64")      # head dim 64: the vectorised decode kernels


@pytest.fixture(scope="module")
def oracle(head64):
    prompts = [head64.tokenizer.encode(p) for p in PROMPTS]
    return prompts, [hf_greedy(head64.hf, p, TOKENS) for p in prompts]


def sure_partings(llm, hf, oracle) -> list[tuple[int, int, float]]:
    """(prompt, token index, the oracle's logit lead) where our greedy tokens first part from the
    oracle's and the oracle's token leads ours by more than MARGIN."""
    prompts, refs = oracle
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=TOKENS, min_tokens=TOKENS), use_tqdm=False)
    sure = []
    for i, (p, ref, out) in enumerate(zip(prompts, refs, outs)):
        ours = out.outputs[0].token_ids
        j = next((k for k, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
        if j is None:
            continue
        with torch.no_grad():
            logits = hf(torch.tensor([p + ref[:j]])).logits[0, -1]
        lead = (logits[ref[j]] - logits[ours[j]]).item()
        if lead > MARGIN:
            sure.append((i, j, lead))
    return sure


@pytest.mark.parametrize("name", ["fp8_e4m3", "int8"])
def test_greedy_keeps_the_oracle_tokens_and_fails_without_the_scales(head64, oracle, name, monkeypatch):
    llm = make_llm(head64, kv_cache_dtype=name, enable_prefix_caching=False)
    assert sure_partings(llm, head64.hf, oracle) == []
    # The mutation: the Python layer loop (writes through cpu.write_kv), each row's scale then
    # overwritten with bf16 1.0, so attention reads the raw codes.
    llm.engine.runner.model.compiled_layers = None
    write = cpu.write_kv

    def scale_dropped(kv_cache, k, v, slot_mapping, kv_code=0):
        ok = write(kv_cache, k, v, slot_mapping, kv_code)
        kv_cache[..., -2:] = torch.tensor([0x80, 0x3F], dtype=torch.uint8)     # bf16 1.0, little-endian
        return ok

    monkeypatch.setattr(cpu, "write_kv", scale_dropped)
    assert sure_partings(llm, head64.hf, oracle), "dropping the scales should part from the oracle"
