"""Speculative method draft_model (spec_decode/draft_model.py): a draft model's greedy proposals,
verified in the batched step.

The draft model keeps its own KV in the target's blocks. A draft that is the target (same
weights) has every draft accepted, and greedy output is plain decoding's and the transformers
oracle's; a draft with other weights (same vocabulary) changes what is proposed, never what is
emitted; sampled output follows the target (chi-square on a tiny model); preemption (both
modes), prefix caching and forked sequences keep both caches right. Every engine checks the
paging invariants after each step (conftest sets PAGEDSERVE_CHECK_INVARIANTS).
"""
import json

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.config import EngineConfig
from tests.conftest import hf_greedy
from tests.test_engine import assert_no_blocks_held
from tests.test_spec_decode import TEXTS, run

K = 3


def draft_spec(path: str, k: int = K, **kw) -> dict:
    return {"method": "draft_model", "model": path, "num_speculative_tokens": k, "disable_by_batch_size": 64, **kw}


def make(tm, draft_path: str | None, **kw):
    kw.setdefault("dtype", "float32")
    kw.setdefault("num_gpu_blocks_override", 256)
    return LLM(tm.path, speculative_config=draft_spec(draft_path) if draft_path else None, **kw)


def counters(llm) -> tuple[int, int, int]:
    s = llm.kv_cache_stats()
    return s["spec_decode_num_drafts"], s["spec_decode_num_draft_tokens"], s["spec_decode_num_accepted_tokens"]


@pytest.fixture(scope="module")
def prompts(tiny_llama):
    return [tiny_llama.tokenizer.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def other(tiny_models):
    return tiny_models("llama_mha_tied")   # other random weights, other KV heads, the same vocabulary


@pytest.fixture(scope="module")
def plain(tiny_llama):
    return make(tiny_llama, None)


@pytest.fixture(scope="module")
def self_draft(tiny_llama):
    return make(tiny_llama, tiny_llama.path)


@pytest.fixture(scope="module")
def other_draft(tiny_llama, other):
    return make(tiny_llama, other.path)


GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


# ---- config ---------------------------------------------------------------------------------
def test_config_takes_vllm_keys():
    c = EngineConfig(speculative_config=json.dumps({"model": "/m/draft.gguf", "num_speculative_tokens": 4})
                     ).speculative_config
    assert (c.method, c.model, c.num_speculative_tokens) == ("draft_model", "/m/draft.gguf", 4)   # method inferred
    c = EngineConfig(speculative_config={"method": "draft_model", "model": "org/name", "num_speculative_tokens": 2,
                                         "quantization": "q8_0", "draft_tensor_parallel_size": 1}).speculative_config
    assert (c.quantization, c.draft_tensor_parallel_size) == ("q8_0", 1)


@pytest.mark.parametrize("bad,match", [
    ({"method": "draft_model", "num_speculative_tokens": 3}, "needs 'model'"),
    ({"method": "ngram", "model": "x", "num_speculative_tokens": 3}, "key 'model'.*method 'draft_model'"),
    ({"model": "x", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 2}, "draft_tensor_parallel_size"),
    ({"model": "x", "num_speculative_tokens": 3, "quantization": "awq"}, "quantization 'awq'"),
])
def test_bad_draft_configs_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(speculative_config=bad)


def test_tensor_parallel_is_refused():
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(speculative_config=draft_spec("x"), tensor_parallel_size=2)


def test_a_draft_with_another_vocabulary_is_refused(tiny_llama, tmp_path):
    import transformers
    cfg = transformers.LlamaConfig(vocab_size=len(tiny_llama.tokenizer) + 64, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                   max_position_embeddings=512)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "draft")
    tiny_llama.tokenizer.save_pretrained(tmp_path / "draft")
    with pytest.raises(ValueError, match="speculative_config model .* vocabulary"):
        make(tiny_llama, str(tmp_path / "draft"))


# ---- exact greedy output ------------------------------------------------------------------
def test_the_target_as_its_own_draft_accepts_every_draft(plain, self_draft, prompts, tiny_llama):
    before = counters(self_draft)
    out = run(self_draft, prompts, GREEDY)
    assert out == run(plain, prompts, GREEDY)
    drafts, draft_tokens, accepted = (a - b for a, b in zip(counters(self_draft), before))
    assert drafts > 0 and accepted == draft_tokens
    for p, o in zip(prompts, out):
        assert list(o[0][0]) == hf_greedy(tiny_llama.hf, p, GREEDY.max_tokens)
    assert_no_blocks_held(self_draft)


def test_another_draft_gives_plain_decodings_tokens(plain, other_draft, prompts):
    before = counters(other_draft)
    assert run(other_draft, prompts, GREEDY) == run(plain, prompts, GREEDY)
    drafts, draft_tokens, accepted = (a - b for a, b in zip(counters(other_draft), before))
    assert drafts > 0 and draft_tokens >= drafts and accepted < draft_tokens
    assert_no_blocks_held(other_draft)


def test_parallel_sampling_best_of_and_max_tokens(plain, self_draft, prompts):
    """n = 2 greedy (forks share the draft model's KV too, copied on write), logprobs, a
    max_tokens cut inside the drafts; best_of = 3 sampled and seeded: reproducible."""
    for params in (SamplingParams(temperature=0, n=2, max_tokens=13, ignore_eos=True, logprobs=1),
                   SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)):
        assert run(self_draft, prompts, params) == run(plain, prompts, params)
    params = SamplingParams(n=1, best_of=3, temperature=0.7, seed=3, max_tokens=20, ignore_eos=True)
    a = run(self_draft, prompts, params)
    assert a == run(self_draft, prompts, params)
    assert all(len(r) == 1 and len(r[0][0]) == 20 for r in a)
    assert_no_blocks_held(self_draft)


def test_prefix_caching_with_a_draft(plain, self_draft, prompts):
    """Prompts extended by their outputs hit blocks the first run hashed; the draft model's KV
    there is right (every draft still accepted) and output is plain decoding's."""
    first = run(self_draft, prompts, GREEDY)
    hits = self_draft.kv_cache_stats()["prefix_cache_hits"]
    longer = [p + r[0][0][:16] for p, r in zip(prompts, first)]
    before = counters(self_draft)
    assert run(self_draft, longer, GREEDY) == run(plain, longer, GREEDY)
    assert self_draft.kv_cache_stats()["prefix_cache_hits"] > hits
    _, draft_tokens, accepted = (a - b for a, b in zip(counters(self_draft), before))
    assert draft_tokens > 0 and accepted == draft_tokens
    assert_no_blocks_held(self_draft)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_with_a_draft(tiny_llama, plain, prompts, mode):
    """Swapping moves both caches' blocks, recomputing recomputes both: every draft of the
    target-as-draft is still accepted."""
    kw = dict(block_size=4, num_gpu_blocks_override=40, preemption_mode=mode)
    if mode == "swap":
        from tests.test_preemption import host_bytes
        kw["swap_space"] = host_bytes(tiny_llama, 64) * 4 / 1024**3   # 64 blocks of 4 tokens, both models
    llm = make(tiny_llama, tiny_llama.path, **kw)
    ps = [[7 + r] + p for r in range(3) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    assert run(llm, ps, params) == run(plain, ps, params)
    stats = llm.kv_cache_stats()
    assert stats["num_preemptions"] > 0
    assert 0 < stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"]
    assert_no_blocks_held(llm)


def test_drafts_off_above_disable_by_batch_size_then_catch_up(tiny_llama, plain, prompts):
    """Above disable_by_batch_size the draft model does not run; once fewer requests run, it
    catches up on the tokens it missed (and its drafts are right again: all accepted)."""
    llm = LLM(tiny_llama.path, dtype="float32", num_gpu_blocks_override=256,
              speculative_config=draft_spec(tiny_llama.path, disable_by_batch_size=1))
    short = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    long = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    ps = [{"prompt_token_ids": p} for p in prompts[:2]]
    outs = llm.generate(ps, [long, short], use_tqdm=False)
    ref = plain.generate(ps, [long, short], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    _, draft_tokens, accepted = counters(llm)
    assert 0 < accepted == draft_tokens
    assert_no_blocks_held(llm)


# ---- sampled output ---------------------------------------------------------------------------
@pytest.mark.parametrize("residual", [True, False])
def test_sampled_output_follows_the_target(tiny_llama, prompts, residual, monkeypatch):
    """The second output token's distribution (the first one drafts reach), joint with the
    first, against the target's own probabilities from transformers (top_k=3 keeps the cells
    few): a chi-square test over seeded requests with the target as its own greedy draft, so
    drafts are both accepted (p(d)) and rejected (the residual). Without the residual step
    (a rejected draft resampled from p itself) the test fails."""
    if not residual:
        import functools

        from pagedserve.spec_decode import rejection
        from pagedserve.worker import model_runner
        monkeypatch.setattr(model_runner, "verify", functools.partial(rejection.verify, residual=False))
    top_k, trials = 3, 1200
    llm = LLM(tiny_llama.path, dtype="float32", num_gpu_blocks_override=2048, max_num_seqs=256,
              speculative_config=draft_spec(tiny_llama.path, k=1, disable_by_batch_size=1024))
    prompt = prompts[3]
    params = [SamplingParams(temperature=1.5, top_k=top_k, max_tokens=3, ignore_eos=True, seed=i)
              for i in range(trials)]
    outs = llm.generate([{"prompt_token_ids": prompt}] * trials, params, use_tqdm=False)
    _, draft_tokens, accepted = counters(llm)
    assert 0 < accepted < draft_tokens          # both branches of the verification ran
    pairs = [tuple(o.outputs[0].token_ids[:2]) for o in outs]

    def top(ids: list[int]) -> tuple[list[int], torch.Tensor]:
        with torch.no_grad():
            logits = tiny_llama.hf(torch.tensor([ids])).logits[0, -1] / 1.5
        v, i = logits.topk(top_k)
        return i.tolist(), torch.softmax(v, -1)

    first_ids, first_p = top(prompt)
    cells, expected = [], []
    for t1, p1 in zip(first_ids, first_p):
        second_ids, second_p = top(prompt + [t1])
        for t2, p2 in zip(second_ids, second_p):
            cells.append((t1, t2))
            expected.append(float(p1 * p2) * trials)
    counts = [pairs.count(c) for c in cells]
    assert sum(counts) == trials                # nothing outside the top-k cells
    chi2 = sum((c - e) ** 2 / e for c, e in zip(counts, expected))
    assert (chi2 < 26.12) == residual           # df = 8: P(chi2 > 26.12) = 0.001


def test_a_quantized_copy_of_the_target_drafts(tiny_llama, plain, prompts):
    """The draft is the target quantized to Q8_0 at load (speculative_config's quantization):
    output is plain decoding's, and most drafts are accepted."""
    llm = LLM(tiny_llama.path, dtype="float32", num_gpu_blocks_override=256,
              speculative_config=draft_spec(tiny_llama.path, quantization="q8_0"))
    assert run(llm, prompts, GREEDY) == run(plain, prompts, GREEDY)
    _, draft_tokens, accepted = counters(llm)
    assert draft_tokens > 0 and accepted > 0.5 * draft_tokens
    assert_no_blocks_held(llm)


def test_the_kv_cache_counts_both_models_per_block(tiny_llama, other):
    """The draft's KV lives in the target's blocks: a block's bytes are both models'."""
    from pagedserve.worker.model_runner import kv_cache_bytes_per_block

    def block_bytes(tm) -> int:
        c = tm.hf.config
        return kv_cache_bytes_per_block(c.num_hidden_layers, 16, c.num_key_value_heads,
                                        c.hidden_size // c.num_attention_heads, torch.float32)

    memory = 1 << 20
    plain = LLM(tiny_llama.path, dtype="float32", kv_cache_memory=memory, block_size=16)
    drafted = LLM(tiny_llama.path, dtype="float32", kv_cache_memory=memory, block_size=16,
                  speculative_config=draft_spec(other.path))
    assert plain.kv_cache_stats()["num_blocks"] == memory // block_bytes(tiny_llama)
    assert drafted.kv_cache_stats()["num_blocks"] == memory // (block_bytes(tiny_llama) + block_bytes(other))
    draft = drafted.engine.runner.draft
    assert draft.kv_cache.shape[2] == drafted.kv_cache_stats()["num_blocks"]


def test_structured_output_and_beam_search_run_without_the_draft(plain, self_draft, prompts, monkeypatch):
    """Requests that may not speculate get no drafts, and the draft model skips them."""
    from pagedserve import StructuredOutputsParams
    from pagedserve.sampling_params import BeamSearchParams
    from pagedserve.spec_decode.draft_model import DraftModel
    calls = []
    monkeypatch.setattr(DraftModel, "_forward", lambda self, rows, at: calls.append(rows) or [])
    before = counters(self_draft)
    params = SamplingParams(temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(regex="(ab)+c"))
    assert run(self_draft, prompts[:1], params) == run(plain, prompts[:1], params)
    beams = BeamSearchParams(beam_width=2, max_tokens=6)
    ps = [{"prompt_token_ids": prompts[0]}]
    assert [o.sequences[0].tokens for o in self_draft.beam_search(ps, beams)] == \
        [o.sequences[0].tokens for o in plain.beam_search(ps, beams)]
    assert counters(self_draft) == before and not calls
