"""Greedy output of the default model (in its GGUF blocks) does not depend on the batch: the same
request alone, among other requests and after a prefix-cache hit gives the
same tokens and logprobs, where its quantized products run in r8 layouts (the avx2 / avxvnni
kernels: a row's arithmetic does not depend on how many rows share the call; csrc/quant/dot_r8_256.h),
and greedy n-gram and suffix speculation give plain decoding's tokens and logprobs."""
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


# Prompts whose continuations repeat, so that the n-gram and suffix proposers draft often.
REPEATING = ["The capital of France is Paris. The capital of Germany is Berlin. The capital of",
             "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\ndef",
             "one two three four five six seven eight nine ten one two three four",
             "Write a list of fruits: apple, banana, cherry, apple, banana,"]


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_greedy_speculation_gives_plain_decodings_tokens_and_logprobs(method):
    """Verification rows attend one by one as decode rows (csrc/attention/paged_attention.h) and
    take the decode rows' products: drafted steps give plain decoding's tokens and logprobs, bit
    for bit, on the quantized default model, alone and four at a time. (Before, the verification
    chunk took the tiled prefill attention: the text changed from its 40th token.)"""
    try:
        default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3} \
        if method == "ngram" else {"method": "suffix", "num_speculative_tokens": 4}
    params = SamplingParams(temperature=0, max_tokens=120, min_tokens=120, logprobs=1)

    def outputs(llm: LLM, prompts: list[str]) -> list:
        return [(o.outputs[0].token_ids, [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])
                for o in llm.generate(prompts, params, use_tqdm=False)]
    plain = LLM(kv_cache_memory=64 * 1024**2)
    want_alone = [outputs(plain, [p])[0] for p in REPEATING]
    want_batched = outputs(plain, REPEATING)
    drafted = LLM(kv_cache_memory=64 * 1024**2, speculative_config=spec)
    assert [outputs(drafted, [p])[0] for p in REPEATING] == want_alone
    assert outputs(drafted, REPEATING) == want_batched
    assert drafted.kv_cache_stats()["spec_decode_num_accepted_tokens"] > 200
