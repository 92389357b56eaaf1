"""Speculative decoding (spec_decode/): n-gram drafts verified in the batched step.

Greedy output with drafts is token for token plain decoding's (and the transformers oracle's),
under n > 1 / best_of, stop strings, max_tokens cut inside accepted drafts, prefix caching and
preemption; sampled output follows the target distribution (a statistical test of the rejection
sampler that fails without the residual step). Every engine checks the paging invariants after
each step (conftest sets PAGEDSERVE_CHECK_INVARIANTS).
"""
import json

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.batch import SamplingSettings
from pagedserve.config import EngineConfig
from pagedserve.engine.stats import SchedulerStats
from pagedserve.sampling.sampler import Sampler, SamplingRow
from pagedserve.server.metrics import PrometheusStatLogger
from pagedserve.spec_decode import ngram, rejection
from pagedserve.spec_decode.rejection import DraftRow, verify
from tests.conftest import hf_greedy
from tests.test_engine import assert_no_blocks_held

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
TEXTS = [
    "one two three four five one two three four five one two",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick",
    "def add(a, b):\n    return a + b\ndef add(a, b):\n    return a + b\n",
    "Paged attention stores keys and values in fixed-size blocks.",
]


def make(tm, spec=SPEC, **kw):
    kw.setdefault("dtype", "float32")
    kw.setdefault("num_gpu_blocks_override", 256)
    return LLM(tm.path, speculative_config=spec, **kw)


def run(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def prompts(tiny_llama):
    return [tiny_llama.tokenizer.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def plain(tiny_llama):
    return make(tiny_llama, spec=None)


@pytest.fixture(scope="module")
def spec(tiny_llama):
    return make(tiny_llama, spec={**SPEC, "disable_by_batch_size": 64})


def accepted(llm) -> int:
    return llm.kv_cache_stats()["spec_decode_num_accepted_tokens"]


# ---- config ---------------------------------------------------------------------------------
def test_config_takes_vllm_keys_and_json():
    c = EngineConfig(speculative_config=json.dumps({"method": "ngram", "num_speculative_tokens": 5,
                                                    "prompt_lookup_max": 4})).speculative_config
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 5, 4, 4)
    assert c.disable_by_batch_size == 4
    assert EngineConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                            "disable_by_batch_size": 9}).speculative_config.disable_by_batch_size == 9
    assert EngineConfig().speculative_config is None


@pytest.mark.parametrize("method", ["eagle", "eagle3", "medusa", "mtp"])
def test_methods_we_lack_are_refused_by_name(method):
    with pytest.raises(ValueError, match=f"'{method}' is not yet supported"):
        EngineConfig(speculative_config={"method": method, "num_speculative_tokens": 3})


# Every value of its type and range, refused at start (issue 51: these started, then failed each request).
TYPES_AND_RANGES = (({"num_speculative_tokens": 2.5}, "num_speculative_tokens must be an integer"),
                    ({"num_speculative_tokens": "3"}, "num_speculative_tokens must be an integer"),
                    ({"num_speculative_tokens": True}, "num_speculative_tokens must be an integer"),
                    ({"prompt_lookup_max": 2.5}, "prompt_lookup_max must be an integer"),
                    ({"prompt_lookup_max": 10**9}, "at most 1024"),
                    ({"min_acceptance": "high"}, "min_acceptance must be a number"),
                    ({"min_acceptance": float("nan")}, "min_acceptance must be a number"),
                    ({"min_acceptance": -0.5}, "min_acceptance >= 0"),
                    ({"min_acceptance_after": -1}, "min_acceptance_after >= 0"),
                    ({"disable_by_batch_size": 1.5}, "disable_by_batch_size must be an integer"),
                    ({"suffix_decoding_max_spec_factor": "x"}, "max_spec_factor must be a number"))


@pytest.mark.parametrize("bad,match", [({"method": "ngram"}, "num_speculative_tokens"),
                                       ({"method": "ngram", "num_speculative_tokens": 0}, r"\[1, 32\]"),
                                       ({"method": "ngram", "num_speculative_tokens": 2, "k": 1}, "unknown keys"),
                                       ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3,
                                         "prompt_lookup_max": 2}, "prompt_lookup_min"),
                                       ("{not json", "JSON"),
                                       *[({"method": "ngram", "num_speculative_tokens": 3, **kv}, match)
                                         for kv, match in TYPES_AND_RANGES],
                                       ({"method": "draft_model", "model": 5, "num_speculative_tokens": 2},
                                        "model must be a string")])
def test_bad_configs_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(speculative_config=bad)


def test_tensor_parallel_is_refused():
    with pytest.raises(ValueError, match="not yet supported with tensor_parallel_size"):
        EngineConfig(speculative_config=SPEC, tensor_parallel_size=2)


def test_cli_flag():
    import argparse

    from pagedserve.cli import add_config_args, config_from_args
    p = argparse.ArgumentParser()
    add_config_args(p, EngineConfig)
    args = p.parse_args(["--speculative-config", json.dumps(SPEC)])
    assert config_from_args(EngineConfig, args).speculative_config.num_speculative_tokens == 3


# ---- the proposer ---------------------------------------------------------------------------
def test_ngram_proposes_what_followed_the_latest_match():
    assert ngram.propose([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 2, 1, 3) == [7, 5]   # the latest of two
    assert ngram.propose([5, 6, 7, 8, 6], 3, 1, 3) == [7, 8, 6]                    # n = 1 after 3, 2 miss
    assert ngram.propose([1, 2, 3, 4], 3, 1, 3) == []
    assert ngram.propose([4, 1, 2, 4], 3, 2, 3) == []                               # n >= 2 only
    assert ngram.propose([1, 2, 1, 2], 5, 1, 2) == [1, 2]                           # what there is


def test_suffix_drafts_follow_the_longest_match_while_confident():
    from pagedserve.spec_decode.suffix import SuffixProposer
    s = SuffixProposer(max_depth=8, max_cached_requests=2, max_spec_factor=1.0, min_token_prob=0.5)
    assert s.propose([1, 2, 3, 4, 5, 1, 2, 3], 8) == [4, 5, 1]     # match of 3: at most 3 tokens
    s.add_output([7, 8, 9, 10, 11, 12])
    assert s.propose([5, 6, 7, 8, 9], 8) == [10, 11, 12]            # from a cached output
    s.add_output([7, 8, 9, 20, 21, 22])
    # Two matches of 3 disagree on what follows: each has half, enough for min_token_prob 0.5.
    assert s.propose([5, 7, 8, 9], 8) in ([10, 11, 12], [20, 21, 22])
    s.min_token_prob = 0.6
    assert s.propose([5, 7, 8, 9], 8) == []
    s.add_output([1, 1])
    s.add_output([2, 2])
    assert len(s.cache) == 2                                        # bounded: the oldest left
    assert SuffixProposer().propose([1, 2, 3], 4) == []


def test_suffix_cache_is_kept_apart_per_tenant_and_adapter():
    """Outputs cached under one scope (a KV salt) never draft another's (issue 51: acceptance,
    i.e. latency, told one tenant what another generated)."""
    from pagedserve.kv.block_pool import kv_salt
    from pagedserve.spec_decode.suffix import SuffixProposer
    s = SuffixProposer(max_depth=8, max_cached_requests=3, max_spec_factor=1.0, min_token_prob=0.5)
    tenant_a, adapter = kv_salt("a", None), kv_salt("a", "1:f00")
    s.add_output([7, 8, 9, 10, 11, 12], tenant_a)
    assert s.propose([5, 6, 7, 8, 9], 8, tenant_a) == [10, 11, 12]
    for other in (None, kv_salt("b", None), adapter):
        assert s.propose([5, 6, 7, 8, 9], 8, other) == [], other
    s.add_output([1, 1], None)
    s.add_output([2, 2], None)
    s.add_output([3, 3], adapter)                                   # the bound counts every scope
    assert s.propose([5, 6, 7, 8, 9], 8, tenant_a) == [] and len(s.cache) == 3


def test_suffix_drafts_of_one_salt_are_not_another_salts(tiny_llama, prompts):
    """Through the engine: a request of tenant b after tenant a's identical one gets exactly the
    drafts it would get alone; tenant a's second request gets more from its own cache."""
    spec = {"method": "suffix", "num_speculative_tokens": 8}
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)

    def accepted(llm, salt):
        before = llm.kv_cache_stats()["spec_decode_num_accepted_tokens"]
        llm.generate([{"prompt_token_ids": prompts[3], "cache_salt": salt}], params, use_tqdm=False)
        return llm.kv_cache_stats()["spec_decode_num_accepted_tokens"] - before

    alone = accepted(make(tiny_llama, spec=spec), "b")
    llm = make(tiny_llama, spec=spec)
    accepted(llm, "a")
    assert accepted(llm, "b") == alone
    assert accepted(llm, "a") > alone


def test_suffix_method_is_exact_and_learns_from_earlier_outputs(tiny_llama, plain, prompts):
    llm = make(tiny_llama, spec={"method": "suffix", "num_speculative_tokens": 8})
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    assert run(llm, prompts, params) == run(plain, prompts, params)
    first = llm.kv_cache_stats()
    # The same prompts again: the cached outputs predict most of what comes.
    assert run(llm, prompts, params) == run(plain, prompts, params)
    second = llm.kv_cache_stats()
    rate = (second["spec_decode_num_accepted_tokens"] - first["spec_decode_num_accepted_tokens"]) / \
        (second["spec_decode_num_draft_tokens"] - first["spec_decode_num_draft_tokens"])
    assert rate > 0.9 and second["spec_decode_mean_accepted_length"] > first["spec_decode_mean_accepted_length"]
    assert_no_blocks_held(llm)


# ---- exactness, greedy ----------------------------------------------------------------------
def test_greedy_equals_plain_and_drafts_are_accepted(plain, spec, prompts):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    before = accepted(spec)
    assert run(spec, prompts, params) == run(plain, prompts, params)
    assert accepted(spec) > before
    stats = spec.kv_cache_stats()
    assert 0 < stats["spec_decode_acceptance_rate"] <= 1 and stats["spec_decode_mean_accepted_length"] > 1
    assert sum(stats["spec_decode_num_accepted_tokens_per_pos"]) == stats["spec_decode_num_accepted_tokens"]
    assert_no_blocks_held(spec)


def test_each_draft_is_verified_at_its_own_position(spec, prompts, monkeypatch):
    """The counters against the drafts themselves: a draft token is accepted exactly when it is
    the token greedy decoding puts at its position (no off-by-one between proposal and
    verification, no stale context), and every drafted step also emits the target's own token
    (the bonus token is kept): steps = output tokens - accepted drafts."""
    proposals = []
    real = ngram.propose

    def record(token_ids, k, n_min, n_max):
        drafts = real(token_ids, k, n_min, n_max)
        proposals.append((len(token_ids), drafts))
        return drafts
    monkeypatch.setattr(ngram, "propose", record)
    before = {k: v for k, v in spec.kv_cache_stats().items() if k.startswith("spec_decode_num_")}
    prompt = prompts[1]
    out = spec.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    full = [*prompt, *out]
    # The prefill emits the first token; but where the prompt was cached (an earlier test ran
    # it), its last token is a one-token step of its own, and drafts follow it already.
    from_prompt = proposals[0][0] == len(prompt)
    agree, at_next = 0, len(prompt) + (not from_prompt)
    for at, drafts in proposals:
        assert at == at_next   # proposed from all the tokens so far: none stale, none missing
        m = 0
        while m < len(drafts) and at + m < len(full) and full[at + m] == drafts[m]:
            m += 1
        agree += m
        at_next = at + m + 1   # the accepted drafts and the target's own token
    after = spec.kv_cache_stats()
    accepted_now = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    assert agree == accepted_now > 0
    assert after["spec_decode_num_drafts"] - before["spec_decode_num_drafts"] == sum(1 for _, d in proposals if d)
    assert len(proposals) == len(out) - (not from_prompt) - accepted_now   # a step per proposal call, none lost


def test_transformers_oracle_holds_with_drafts(tiny_llama, spec, prompts):
    for p in prompts[:2]:
        out = spec.generate([{"prompt_token_ids": p}], SamplingParams(temperature=0, max_tokens=24, min_tokens=24),
                            use_tqdm=False)[0]
        assert out.outputs[0].token_ids == hf_greedy(tiny_llama.hf, p, 24)


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 7, 13])
def test_max_tokens_cuts_inside_accepted_drafts(plain, spec, prompts, max_tokens):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    assert run(spec, prompts, params) == run(plain, prompts, params)
    assert_no_blocks_held(spec)


def test_parallel_sampling_and_best_of(plain, spec, prompts):
    """n = 2 greedy: each sequence is plain decoding's (forked blocks copied on write by the
    drafts). best_of = 3 (sampled, seeded): reproducible, each sequence its own drafts."""
    params = SamplingParams(n=2, temperature=0, max_tokens=20, ignore_eos=True)
    before = accepted(spec)
    assert run(spec, prompts, params) == run(plain, prompts, params)
    assert accepted(spec) > before
    params = SamplingParams(n=1, best_of=3, temperature=0.7, seed=3, max_tokens=20, ignore_eos=True)
    a = run(spec, prompts, params)
    assert a == run(spec, prompts, params)
    assert all(len(r) == 1 and len(r[0][0]) == 20 for r in a)
    assert_no_blocks_held(spec)


def _stop_inside_accepted_drafts(tok, tokens: list[int], steps: list[tuple[int, int]]) -> list[str]:
    """Stop strings that first appear in a token which accepted drafts follow in its step:
    steps are (output index of the step's first token, tokens emitted)."""
    full = tok.decode(tokens)
    stops = []
    for i, n in steps:
        if n < 2 or i + 1 >= len(tokens):
            continue
        end = len(tok.decode(tokens[:i + 1]))
        for m in range(2, end):
            cand = full[end - m:end]
            if full.find(cand) == end - m and cand.strip():
                stops.append(cand)
                break
    return stops[:4]


def test_stop_strings_drop_tokens_after_them(plain, spec, prompts, tiny_llama, monkeypatch):
    """A stop string in a token that accepted drafts follow in the same step: those tokens go
    (text, token ids, logprobs and their sum as plain decoding's)."""
    from pagedserve.engine.detokenizer import OutputText
    from pagedserve.scheduler import Scheduler
    steps = []
    verified = Scheduler._append_verified
    monkeypatch.setattr(Scheduler, "_append_verified", lambda self, s, emitted: (
        steps.append((s.seq.num_output_tokens, len(emitted.token_ids))), verified(self, s, emitted)))
    dropped = []
    drop = OutputText._drop_tail
    monkeypatch.setattr(OutputText, "_drop_tail", staticmethod(lambda seq, n: (dropped.append(n), drop(seq, n))))
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    tok = tiny_llama.tokenizer
    for p in prompts[:3]:
        steps.clear()
        tokens = run(spec, [p], params)[0][0][0]
        for stop in _stop_inside_accepted_drafts(tok, tokens, list(steps)):
            sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop], logprobs=1)
            got, want = spec.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0].outputs[0], \
                plain.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0].outputs[0]
            assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == \
                (want.token_ids, want.text, want.finish_reason, want.stop_reason)
            assert len(got.logprobs) == len(want.logprobs)
            assert got.cumulative_logprob == pytest.approx(want.cumulative_logprob, abs=1e-3)
    assert dropped, "no stop string fell inside a step's accepted drafts: the test tests nothing"
    assert_no_blocks_held(spec)


def test_logprobs_of_accepted_tokens_are_plain_decodings(plain, spec, prompts):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
    got = spec.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    want = plain.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for g, w in zip(got, want):
        g, w = g.outputs[0], w.outputs[0]
        assert g.token_ids == w.token_ids
        for pg, pw in zip(g.logprobs, w.logprobs):
            assert list(pg) == list(pw)
            for t in pw:      # equal, not close: verification rows attend as decode rows do
                assert pg[t].logprob == pw[t].logprob and pg[t].rank == pw[t].rank
                assert pg[t].decoded_token == pw[t].decoded_token


def test_penalties_see_the_drafts(plain, spec, prompts):
    """Each position is processed as plain decoding would with the drafts before it as output
    (penalties that favour repeats, so drafts are accepted under them)."""
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, repetition_penalty=0.9,
                            frequency_penalty=-0.3, presence_penalty=0.1, min_tokens=10)
    before = accepted(spec)
    assert run(spec, prompts, params) == run(plain, prompts, params)
    assert accepted(spec) > before


def test_prefix_caching_with_drafts(plain, spec, prompts):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    first = run(spec, prompts, params)
    hits = spec.kv_cache_stats()["prefix_cache_hits"]
    # The same prompts extended by their outputs: blocks of accepted tokens were hashed.
    longer = [p + r[0][0][:32] for p, r in zip(prompts, first)]
    assert run(spec, longer, params) == run(plain, longer, params)
    assert spec.kv_cache_stats()["prefix_cache_hits"] > hits
    assert_no_blocks_held(spec)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_with_drafts(tiny_llama, plain, prompts, mode):
    kw = dict(block_size=4, num_gpu_blocks_override=40, preemption_mode=mode)
    if mode == "swap":
        from tests.test_preemption import host_bytes
        kw["swap_space"] = host_bytes(tiny_llama, 64) * 2 / 1024**3   # 64 blocks of 4 tokens
    llm = make(tiny_llama, spec={**SPEC, "disable_by_batch_size": 64}, **kw)
    ps = [[7 + r] + p for r in range(3) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    assert run(llm, ps, params) == run(plain, ps, params)
    stats = llm.kv_cache_stats()
    assert stats["num_preemptions"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0
    assert_no_blocks_held(llm)


def test_structured_output_requests_run_without_drafts(plain, spec, prompts):
    from pagedserve import StructuredOutputsParams
    params = SamplingParams(temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(regex="(ab)+c"))
    drafts = spec.kv_cache_stats()["spec_decode_num_drafts"]
    assert run(spec, prompts[:1], params) == run(plain, prompts[:1], params)
    assert spec.kv_cache_stats()["spec_decode_num_drafts"] == drafts


# ---- never a net loss -----------------------------------------------------------------------
def test_no_drafts_above_disable_by_batch_size(tiny_llama, prompts):
    llm = make(tiny_llama, spec={**SPEC, "disable_by_batch_size": 1})
    llm.generate([{"prompt_token_ids": p} for p in prompts[:3]],
                 SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    assert llm.kv_cache_stats()["spec_decode_num_drafts"] == 0
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                 use_tqdm=False)
    assert llm.kv_cache_stats()["spec_decode_num_drafts"] > 0


def test_low_acceptance_stops_a_requests_drafts(tiny_llama, prompts):
    llm = make(tiny_llama, spec={**SPEC, "min_acceptance": 1.01, "min_acceptance_after": 2})
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                 use_tqdm=False)
    assert llm.kv_cache_stats()["spec_decode_num_drafts"] == 2


# ---- sampled: the target distribution -------------------------------------------------------
def test_seeded_sampling_with_drafts_is_reproducible(spec, prompts):
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, max_tokens=30, seed=7, ignore_eos=True)
    a = run(spec, prompts, params)
    assert run(spec, prompts[:1], params) == a[:1]      # the batch does not matter
    assert run(spec, prompts, params) == a


def test_each_position_counts_the_drafts_before_it():
    """Row j's penalties count drafts 1..j as output: here draft 1's token, penalised in row 2,
    lets draft 2 win; without counting it, draft 2 is rejected."""
    logits = torch.tensor([[9.0, 0.0, 0.0, 0.0],      # row 1: draft 0 is the argmax
                           [5.5, 5.0, 0.0, 0.0],      # row 2: 0 leads by 0.5 until penalised by 1.0
                           [0.0, 0.0, 9.0, 0.0]])     # row 3: the bonus token
    row = SamplingRow(SamplingSettings(frequency_penalty=1.0), 0, [3], None, None)
    out = verify(Sampler(set()), logits, [DraftRow(row, [0, 1])])[0]
    assert out.token_ids == [0, 1, 2]


def _counts(trials: int, probs: list[float], drafts: list[int], residual: bool, position: int) -> torch.Tensor:
    """Where `position` is emitted, how often each token is, over seeded trials of verify()."""
    V = len(probs)
    logits = torch.log(torch.tensor(probs)).repeat(len(drafts) + 1, 1)
    sampler = Sampler(set())
    gen = torch.Generator().manual_seed(1)
    counts = torch.zeros(V)
    settings = SamplingSettings(temperature=1.0)
    for _ in range(trials):
        row = SamplingRow(settings, 0, None, None, gen)
        out = verify(sampler, logits.clone(), [DraftRow(row, list(drafts))], residual=residual)[0]
        if len(out.token_ids) > position:
            counts[out.token_ids[position]] += 1
    return counts


def _chi2(counts: torch.Tensor, probs: list[float]) -> float:
    expected = counts.sum() * torch.tensor(probs)
    return float(((counts - expected) ** 2 / expected).sum())


# df = 4: P(chi2 > 18.47) = 0.001
CHI2_CRIT = 18.47
PROBS = [0.4, 0.25, 0.15, 0.12, 0.08]


@pytest.mark.parametrize("draft", [0, 3])
def test_rejection_sampling_follows_the_target(draft):
    """The first token emitted follows p whether the draft is likely or not; without the
    residual step (resampling from p itself) it does not."""
    good = _counts(4000, PROBS, [draft], residual=True, position=0)
    assert _chi2(good, PROBS) < CHI2_CRIT
    bad = _counts(4000, PROBS, [draft], residual=False, position=0)
    assert _chi2(bad, PROBS) > CHI2_CRIT


def test_the_token_after_accepted_drafts_follows_the_target():
    counts = _counts(3000, PROBS, [0, 0], residual=True, position=2)   # both drafts accepted: the bonus
    assert counts.sum() > 300 and _chi2(counts, PROBS) < CHI2_CRIT


# A different distribution at each of the 1 + k positions (issue 51: with equal rows a verifier
# drawing the bonus token from p_0, or accepting by row 0's probability, passed every test).
PER_POSITION = [PROBS, [0.05, 0.1, 0.15, 0.3, 0.4], [0.2, 0.5, 0.05, 0.05, 0.2]]
DRAFTS = [0, 3]


def _position_counts(trials: int) -> list[torch.Tensor]:
    """Per position j, how often each token is emitted there among the trials whose drafts before
    j were all accepted (then the token at j follows p_j: draft accepted or the residual's draw)."""
    logits = torch.log(torch.tensor(PER_POSITION))
    sampler, gen = Sampler(set()), torch.Generator().manual_seed(3)
    counts = [torch.zeros(len(PROBS)) for _ in PER_POSITION]
    for _ in range(trials):
        row = SamplingRow(SamplingSettings(temperature=1.0), 0, None, None, gen)
        out = verify(sampler, logits.clone(), [DraftRow(row, list(DRAFTS))])[0].token_ids
        for j, token in enumerate(out):
            if out[:j] == DRAFTS[:j]:
                counts[j][token] += 1
    return counts


def _wrong_row(bug: str):
    """rejection._accept_sampled with one row mixed up: the bonus drawn from p_0 ("bonus"), or
    each draft accepted with row 0's probability ("accept")."""
    def accept(sampler, logits, d, residual):
        probs = torch.softmax(logits / d.row.params.temperature, dim=-1)
        gen = d.row.generator
        tokens = []
        for j, draft in enumerate(d.draft_token_ids):
            if torch.rand(1, generator=gen).item() < probs[0 if bug == "accept" else j, draft].item():
                tokens.append(draft)
                continue
            dist = probs[j].clone()
            dist[draft] = 0.0
            return tokens + [rejection._draw(dist, d.row, gen)]
        return tokens + [rejection._draw(probs[0 if bug == "bonus" else -1], d.row, gen)]
    return accept


def test_each_position_follows_its_own_row(monkeypatch):
    """Chi-square at every position j = 0..k against p_j, rows all different; a verifier that
    reads a wrong row at the bonus or at the acceptance fails at that position."""
    counts = _position_counts(3000)
    assert counts[2].sum() > 250, "too few trials reach the bonus token"
    for j, (c, p) in enumerate(zip(counts, PER_POSITION)):
        assert _chi2(c, p) < CHI2_CRIT, (j, c)
    for bug, position in (("bonus", 2), ("accept", 1)):
        monkeypatch.setattr(rejection, "_accept_sampled", _wrong_row(bug))
        wrong = _position_counts(3000)
        assert _chi2(wrong[position], PER_POSITION[position]) > CHI2_CRIT, bug


# ---- metrics --------------------------------------------------------------------------------
def test_spec_decode_counters_on_metrics(spec, prompts):
    spec.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
                  use_tqdm=False)
    s = spec.engine.scheduler_stats()
    assert s.spec_decode_num_drafts > 0 and s.spec_decode_num_accepted_tokens > 0
    # The dashboard's snapshot carries them with the other counters.
    counters = spec.kv_snapshot()["counters"]
    assert counters["spec_decode_num_accepted_tokens"] == s.spec_decode_num_accepted_tokens
    for prefix in ("pagedserve:", "vllm:"):
        logger = PrometheusStatLogger("m", prefix=prefix)
        logger.record(SchedulerStats(), None)
        logger.record(s, None)
        text = logger.render().decode()
        for name in ("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                     "spec_decode_num_accepted_tokens_total"):
            line = next(x for x in text.splitlines() if x.startswith(prefix + name + "{"))
            assert float(line.split()[-1]) == getattr(s, name[:-len("_total")])
        per_pos = [x for x in text.splitlines() if x.startswith(prefix + "spec_decode_num_accepted_tokens_per_pos")]
        assert sum(float(x.split()[-1]) for x in per_pos) == s.spec_decode_num_accepted_tokens
        assert 'position="0"' in per_pos[0]


def test_periodic_log_line_reports_acceptance(caplog):
    import logging

    from pagedserve.engine.stats import LoggingStatLogger
    log = LoggingStatLogger(interval=0.0)
    log.record(SchedulerStats(num_running=1, spec_decode_num_drafts=4, spec_decode_num_draft_tokens=12,
                              spec_decode_num_accepted_tokens=6), None)
    with caplog.at_level(logging.INFO, logger="pagedserve.engine"):
        log.maybe_log()
    assert any("draft acceptance rate: 50.0%, mean accepted length: 2.50" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_serve_flag_and_metrics_end_to_end(tiny_llama, plain, prompts, tmp_path, method):
    """`serve --speculative-config JSON`: completions as plain decoding's, vLLM's counters on
    /metrics; a draft model named by "model" alone (the method inferred, as vLLM does)."""
    import httpx

    from pagedserve.server.launcher import launch_server
    from tests.server_utils import metrics, tiny_server_args
    spec = SPEC if method == "ngram" else {"model": tiny_llama.path, "num_speculative_tokens": 3}
    srv = launch_server(tiny_llama.path, tiny_server_args("--speculative-config", json.dumps(spec),
                                                          "--shutdown-timeout", "0"), tmp_path / "server.log")
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            body = http.post("/v1/completions", json={"model": tiny_llama.path, "prompt": prompts[0],
                                                      "max_tokens": 24, "temperature": 0,
                                                      "ignore_eos": True}).json()
            want = plain.generate([{"prompt_token_ids": prompts[0]}],
                                  SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)
            assert body["choices"][0]["text"] == want[0].outputs[0].text
            m = metrics(http)
            assert m["pagedserve:spec_decode_num_drafts_total"] > 0
            assert m["pagedserve:spec_decode_num_accepted_tokens_total"] > 0
            assert m['pagedserve:spec_decode_num_accepted_tokens_per_pos_total{position="0"}'] > 0
    finally:
        assert srv.stop() == 0, srv.log()[-3000:]
