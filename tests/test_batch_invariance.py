"""Greedy output of the default model (in its GGUF blocks) does not depend on the batch: the same
request alone, among other requests and after a prefix-cache hit gives the
same tokens and logprobs, where its quantized products run in r8 layouts (the avx2 / avxvnni
kernels: a row's arithmetic does not depend on how many rows share the call; csrc/quant/dot_r8_256.h)."""
import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.kernels import quant
from pagedserve.models.loader import default_model_path

pytestmark = pytest.mark.skipif(quant.variant() not in quant.R8_VARIANTS,
                                reason="the r8 layouts' kernels run on the avx2 / avxvnni variants")

# (every batch of rows takes the integer dots there with quant.set_batch_invariant: R8_ALL_ROWS)
PROMPT = "The capital of France is Paris. The capital of"
OTHERS = ["Once upon a time", "def fibonacci(n):", "Water boils at", "My favourite book is"]


def _run(llm: LLM, prompts: list[str]):
    params = SamplingParams(temperature=0, max_tokens=24, min_tokens=24, logprobs=1)
    out = llm.generate(prompts, params, use_tqdm=False)[0].outputs[0]
    return out.token_ids, [lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)]


def test_greedy_is_the_same_alone_batched_and_cached():
    try:
        default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    quant.set_batch_invariant(True)         # prefill chunks on the integer dots too
    try:
        _check_invariant()
    finally:
        quant.set_batch_invariant(False)


def _check_invariant() -> None:
    llm = LLM(kv_cache_memory=64 * 1024**2, enable_prefix_caching=True)
    assert llm.engine.executor.worker.runner.model.layers[0].qkv.qtype == "q4_1r8"
    alone = _run(llm, [PROMPT])
    assert _run(llm, [PROMPT]) == alone                    # its prompt's full blocks now a prefix-cache hit
    assert _run(llm, [PROMPT] + OTHERS) == alone            # a prefill of 5 prompts, decode steps of 5 rows
    # (n-gram speculation: not yet. Its verification rows' attention differs from a decode step's
    # in the last float bits, on float weights too (logprobs ~1e-6 apart, tokens equal); the 8-bit
    # activations of the next product can round such a difference a step apart.)
