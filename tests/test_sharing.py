"""Memory sharing end to end on tiny models: parallel sampling, best_of, beam search
(against the textbook definition), prefix caching across requests.

Every engine here checks the paging invariants after each step (conftest sets
PAGEDSERVE_CHECK_INVARIANTS) and each test ends with no block held.
"""
import random
from pathlib import Path

import pytest
import torch

from pagedserve import BeamSearchParams, SamplingParams
from pagedserve.sampling.beam_search import beam_score
from tests.beam_reference import beam_score as ref_beam_score
from tests.beam_reference import check_beam_search, reference_beam_search
from tests.conftest import CORPUS, PROMPTS
from tests.test_engine import assert_no_blocks_held, greedy_tokens, make_llm


@pytest.fixture(scope="module")
def prompts(tiny_llama):
    return [tiny_llama.tokenizer.encode(p) for p in PROMPTS]


def token_prompts(ids_list):
    return [{"prompt_token_ids": p} for p in ids_list]


def hf_logprob_sum(hf, prompt: list[int], output: list[int]) -> float:
    with torch.no_grad():
        lps = torch.log_softmax(hf(torch.tensor([prompt + output])).logits[0].double(), -1)
    return sum(lps[len(prompt) - 1 + i, t].item() for i, t in enumerate(output))


# ---- parallel sampling and best_of -------------------------------------------------------------

def test_parallel_greedy_gives_n_copies_of_the_single_output(tiny_llama, prompts):
    llm = make_llm(tiny_llama)
    single = greedy_tokens(llm, prompts[:5], max_tokens=16)
    outs = llm.generate(token_prompts(prompts[:5]), SamplingParams(n=3, temperature=0, max_tokens=16,
                                                                   ignore_eos=True), use_tqdm=False)
    for out, ref in zip(outs, single):
        assert [c.index for c in out.outputs] == [0, 1, 2]
        assert [c.token_ids for c in out.outputs] == [ref] * 3
    assert_no_blocks_held(llm)


def test_parallel_sampling_shares_the_prompt_blocks(tiny_llama):
    """A 40-token prompt in blocks of 16: after the fork the 4 sequences share the two
    full prompt blocks and each owns a copy of the partial one."""
    llm = make_llm(tiny_llama, enable_prefix_caching=False)
    engine, kv = llm.engine, llm.engine.scheduler.kv
    req = engine.add_request("p", {"prompt_token_ids": list(range(3, 43))},
                             SamplingParams(n=4, temperature=1.0, seed=0, max_tokens=8, ignore_eos=True))
    engine.step()                       # the leader computes 39 prompt tokens alone
    assert len(req.seqs) == 1
    engine.step()                       # fork; every sequence computes the last prompt token
    tables = [kv.block_ids(s.seq_id) for s in req.seqs]
    assert len(tables) == 4
    assert all(t[:2] == tables[0][:2] for t in tables)
    assert len({t[2] for t in tables}) == 4
    stats = llm.kv_cache_stats()
    assert stats["num_used_blocks"] == 2 + 4 and stats["num_logical_blocks"] == 4 * 3
    assert stats["sharing_saving"] == pytest.approx(6 / 12)
    while engine.has_unfinished_requests():
        engine.step()
    assert llm.kv_cache_stats()["sharing_saving_avg"] > 0.3
    assert_no_blocks_held(llm)


def test_seeded_parallel_sampling_is_reproducible(tiny_llama, prompts):
    llm = make_llm(tiny_llama)
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=16, ignore_eos=True)
    alone = [c.token_ids for c in llm.generate({"prompt_token_ids": prompts[2]}, params, use_tqdm=False)[0].outputs]
    assert len({tuple(t) for t in alone}) > 1          # the sequences really differ
    other = SamplingParams(n=2, temperature=0.8, max_tokens=20, ignore_eos=True)
    batch = llm.generate(token_prompts([prompts[0], prompts[2], prompts[5]]), [other, params, other],
                         use_tqdm=False)
    assert [c.token_ids for c in batch[1].outputs] == alone
    # Sequence i is seeded with seed + i: each output is reproducible on its own.
    for i, toks in enumerate(alone):
        one = SamplingParams(temperature=1.0, seed=11 + i, max_tokens=16, ignore_eos=True)
        assert llm.generate({"prompt_token_ids": prompts[2]}, one, use_tqdm=False)[0].outputs[0].token_ids == toks
    assert_no_blocks_held(llm)


def test_best_of_returns_the_n_most_likely(tiny_llama, prompts):
    llm = make_llm(tiny_llama)
    p = {"prompt_token_ids": prompts[3]}
    everything = llm.generate(p, SamplingParams(n=5, temperature=1.0, seed=3, max_tokens=10, logprobs=0,
                                                ignore_eos=True), use_tqdm=False)[0].outputs
    for c in everything:   # the ranking key is the model's own log-probability
        assert c.cumulative_logprob == pytest.approx(hf_logprob_sum(tiny_llama.hf, prompts[3], c.token_ids),
                                                     abs=1e-3)
    ranked = sorted(everything, key=lambda c: -c.cumulative_logprob)
    best = llm.generate(p, SamplingParams(n=2, best_of=5, temperature=1.0, seed=3, max_tokens=10,
                                          ignore_eos=True), use_tqdm=False)[0].outputs
    assert [c.token_ids for c in best] == [c.token_ids for c in ranked[:2]]
    assert [c.index for c in best] == [0, 1]
    assert [c.cumulative_logprob for c in best] == pytest.approx([c.cumulative_logprob for c in ranked[:2]])
    assert_no_blocks_held(llm)


# ---- beam search ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def eos_heavy(tiny_models, tiny_root):
    """The tiny Llama with its LM-head row for EOS moved along the mean final hidden state,
    by the amount that makes EOS the most likely token at about a third of the positions of
    a sample text: EOS then competes at many steps and finished hypotheses really occur."""
    import copy
    tm = tiny_models("llama_gqa_untied")
    hf = copy.deepcopy(tm.hf)
    eos = tm.tokenizer.eos_token_id
    ids = torch.tensor([tm.tokenizer.encode(" ".join(CORPUS[:7]))])
    with torch.no_grad():
        out = hf(ids, output_hidden_states=True)
        hidden, logits = out.hidden_states[-1][0], out.logits[0]
        direction = hidden.mean(0) / hidden.mean(0).norm() ** 2
        # Raising the row by s * direction raises EOS's logit at position t by s * (h_t . direction).
        needed = (logits.max(-1).values - logits[:, eos]) / (hidden @ direction)
        hf.lm_head.weight[eos] += needed.quantile(0.35) * direction
    path = Path(tiny_root) / "llama_eos_heavy"
    hf.save_pretrained(path)
    tm.tokenizer.save_pretrained(path)
    return type(tm)(str(path), hf, tm.tokenizer, "llama_eos_heavy")


@pytest.mark.parametrize("name", ["llama_gqa_untied", "qwen2_bias_tied"])
def test_beam_search_equals_the_textbook_definition(tiny_models, name):
    tm = tiny_models(name)
    prompts = [tm.tokenizer.encode(p) for p in PROMPTS[:6]]
    llm = make_llm(tm, block_size=4)
    check_beam_search(llm, tm.hf, prompts, tm.tokenizer.eos_token_id, max_tokens=12)
    assert_no_blocks_held(llm)


def test_beam_search_with_frequent_eos_equals_the_textbook_definition(eos_heavy):
    tm = eos_heavy
    eos = tm.tokenizer.eos_token_id
    prompts = [tm.tokenizer.encode(p) for p in PROMPTS[:6]]
    llm = make_llm(tm, block_size=4)
    seen = check_beam_search(llm, tm.hf, prompts, eos, max_tokens=12)
    # Both EOS rules were exercised: hypotheses that end at EOS, and (ignore_eos) beams
    # that run on through an EOS.
    assert any(h and h[-1] == eos and len(h) < 12 for h in seen)
    assert any(eos in h[:-1] for h in seen)
    assert_no_blocks_held(llm)


def test_beam_search_stops_on_every_eos_id_of_the_generation_config(tiny_llama, tmp_path):
    """A model whose generation config lists two EOS ids: beam search ends a hypothesis on
    either, as sampling stops on either. The second id is a token the best beam generates
    mid-way when only the tokenizer's EOS counts, so it would run through it."""
    prompt = tiny_llama.tokenizer.encode(PROMPTS[5])
    params = BeamSearchParams(beam_width=3, max_tokens=12)
    eos = tiny_llama.tokenizer.eos_token_id
    best = make_llm(tiny_llama, block_size=4).beam_search([{"prompt_token_ids": prompt}], params)[0].sequences[0]
    generated = best.tokens[len(prompt):]
    second_eos = next(t for t in generated[2:-1] if t != eos)

    path = tmp_path / "two_eos"
    path.mkdir()
    for f in Path(tiny_llama.path).iterdir():
        if f.name != "generation_config.json":
            (path / f.name).symlink_to(f)
    (path / "generation_config.json").write_text(f'{{"eos_token_id": [{eos}, {second_eos}]}}')
    llm = make_llm(type(tiny_llama)(str(path), tiny_llama.hf, tiny_llama.tokenizer, "two_eos"), block_size=4)

    out = llm.beam_search([{"prompt_token_ids": prompt}], params)[0]
    ended = []
    for s in out.sequences:
        gen = s.tokens[len(prompt):]
        assert not {eos, second_eos} & set(gen[:-1]), f"a hypothesis ran through an EOS id: {gen}"
        if gen[-1] in (eos, second_eos):
            ended.append(gen)
            assert s.finish_reason == "stop"
    assert any(g[-1] == second_eos for g in ended)
    # The engine's own output for a beam request is those beams, best first.
    req = llm.engine.add_request("beams", {"prompt_token_ids": prompt}, params)
    finals = [o for _ in range(100) for o in llm.engine.step() if o.finished]
    assert [c.token_ids for c in finals[0].outputs] == [s.tokens[len(prompt):] for s in out.sequences]
    assert [c.cumulative_logprob for c in finals[0].outputs] == [s.cum_logprob for s in out.sequences]
    assert req.finished
    # Sampling stops on it too (made the likeliest token by a logit bias).
    sampled = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=12,
                                                                          logit_bias={second_eos: 100.0}),
                           use_tqdm=False)[0].outputs[0]
    assert sampled.finish_reason == "stop" and sampled.token_ids == [second_eos]
    assert_no_blocks_held(llm)


def test_beams_share_blocks_and_pruned_beams_free_them(tiny_llama, prompts):
    llm = make_llm(tiny_llama, block_size=4, enable_prefix_caching=False)
    engine = llm.engine
    req = engine.add_request("b", {"prompt_token_ids": prompts[5]}, BeamSearchParams(beam_width=4, max_tokens=20))
    savings = []
    while engine.has_unfinished_requests():
        engine.step()
        stats = llm.kv_cache_stats()
        if req.live_seqs:
            # Blocks held = distinct blocks in the live beams' tables: pruned beams let go.
            held = {b for s in req.live_seqs for b in engine.scheduler.kv.block_ids(s.seq_id)}
            assert stats["num_used_blocks"] == len(held)
            savings.append(stats["sharing_saving"])
    assert max(savings) > 0.5      # the beams share the whole prompt and common ancestors
    assert_no_blocks_held(llm)


def test_beam_search_params_are_validated():
    with pytest.raises(ValueError, match="beam_width must be an integer >= 1"):
        BeamSearchParams(beam_width=0)
    with pytest.raises(ValueError, match="max_tokens"):
        BeamSearchParams(beam_width=2, max_tokens=0)
    for bad in (1e9, -1e9, float("inf"), float("nan"), 100.5):
        with pytest.raises(ValueError, match="length_penalty must be a number in \\[-100, 100\\]"):
            BeamSearchParams(beam_width=2, length_penalty=bad)


def test_beam_score_ranks_like_the_formula_and_never_overflows():
    """beam_score orders hypotheses as cum_logprob / len ** length_penalty does, computed in log
    space: no length_penalty overflows it (1e9 raised OverflowError, -1e9 ZeroDivisionError)."""
    rng = random.Random(0)
    hyps = [([7] * rng.randint(1, 40), -rng.uniform(0.01, 80.0)) for _ in range(200)] + [([7, 7], 0.0)]
    for penalty in (-100.0, -3.0, -1.0, 0.0, 0.5, 1.0, 2.0, 100.0):
        ours = sorted(hyps, key=lambda h: -beam_score(h[0], h[1], 2, penalty))
        formula = sorted(hyps, key=lambda h: -ref_beam_score(h[0], h[1], 2, penalty))
        assert ours == formula, penalty
    for penalty in (1e9, -1e9, 1e300, -1e300):
        ranked = sorted(hyps, key=lambda h: -beam_score(h[0], h[1], 2, penalty))
        lengths = [len(t) for t, _ in ranked[1:]]   # after the probability-1 hypothesis
        assert lengths == sorted(lengths, reverse=penalty > 0), penalty   # length alone decides


@pytest.mark.parametrize("penalty", [-100.0, 0.0, 2.0, 100.0])
def test_beam_search_with_length_penalty_equals_the_textbook_definition(eos_heavy, penalty):
    tm = eos_heavy
    eos = tm.tokenizer.eos_token_id
    prompts = [tm.tokenizer.encode(p) for p in PROMPTS[:4]]
    llm = make_llm(tm, block_size=4)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                           BeamSearchParams(beam_width=3, max_tokens=10, length_penalty=penalty))
    refs = reference_beam_search(tm.hf, prompts, 3, 10, eos, length_penalty=penalty, num_threads=1)
    for out, (ref, _) in zip(outs, refs):
        assert [s.tokens for s in out.sequences] == [t for t, _ in ref]
    assert_no_blocks_held(llm)


# ---- prefix caching ------------------------------------------------------------------------------

def test_a_prompt_served_twice_hits_the_cache_for_every_full_block(tiny_llama, prompts):
    llm = make_llm(tiny_llama, block_size=4)
    p = prompts[5]
    full = (len(p) - 1) // 4 * 4          # the last token is always computed
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    first = llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0]
    second = llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == full > 0
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    stats = llm.kv_cache_stats()
    assert stats["prefix_cache_queries"] == 2 * len(p) and stats["prefix_cache_hits"] == full
    # Parallel sampling and beam search reuse it too, and give the same results as uncached.
    n2 = SamplingParams(n=2, temperature=0, max_tokens=16, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": p}, n2, use_tqdm=False)[0]
    assert out.num_cached_tokens == full
    assert [c.token_ids for c in out.outputs] == [first.outputs[0].token_ids] * 2
    beam = BeamSearchParams(beam_width=3, max_tokens=10)
    cold = make_llm(tiny_llama, block_size=4, enable_prefix_caching=False).beam_search(
        token_prompts([p]), beam)[0]
    hits_before = llm.kv_cache_stats()["prefix_cache_hits"]
    warm = llm.beam_search(token_prompts([p]), beam)[0]
    assert llm.kv_cache_stats()["prefix_cache_hits"] - hits_before == full
    assert [s.tokens for s in warm.sequences] == [s.tokens for s in cold.sequences]
    assert_no_blocks_held(llm)


def test_cache_salt_keeps_identical_prompts_apart(tiny_llama, prompts):
    """Requests share prefix-cache blocks only with the same cache_salt (none is a salt of its
    own); salted or not, the outputs are those of the unsalted greedy run."""
    llm = make_llm(tiny_llama, block_size=4)
    p = prompts[5]
    full = (len(p) - 1) // 4 * 4
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def run(prompt):
        before = llm.kv_cache_stats()["prefix_cache_hits"]
        out = llm.generate(prompt, params, use_tqdm=False)[0]
        assert llm.kv_cache_stats()["prefix_cache_hits"] - before == out.num_cached_tokens
        return out.num_cached_tokens, out.outputs[0].token_ids

    hits, ref = run({"prompt_token_ids": p})
    assert hits == 0
    assert run({"prompt_token_ids": p, "cache_salt": "tenant-a"}) == (0, ref)
    assert run({"prompt": PROMPTS[5], "cache_salt": "tenant-b"}) == (0, ref)
    assert run({"prompt_token_ids": p, "cache_salt": "tenant-a"}) == (full, ref)
    assert run({"prompt": PROMPTS[5], "cache_salt": "tenant-b"}) == (full, ref)
    assert run({"prompt_token_ids": p}) == (full, ref)
    # Beam search and parallel sampling keep the salt on every sequence.
    beam = BeamSearchParams(beam_width=2, max_tokens=6)
    cold = llm.beam_search([{"prompt_token_ids": p, "cache_salt": "tenant-c"}], beam)[0]
    warm = llm.beam_search([{"prompt_token_ids": p, "cache_salt": "tenant-c"}], beam)[0]
    assert [s.tokens for s in warm.sequences] == [s.tokens for s in cold.sequences]
    out = llm.generate({"prompt_token_ids": p, "cache_salt": "tenant-c"},
                       SamplingParams(n=2, temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    assert out.num_cached_tokens == full and [c.token_ids for c in out.outputs] == [ref] * 2
    for bad in ("", 5, ["a"]):
        with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
            llm.generate({"prompt_token_ids": p, "cache_salt": bad}, params, use_tqdm=False)
    assert_no_blocks_held(llm)


def test_prefix_caching_off_never_hits(tiny_llama, prompts):
    llm = make_llm(tiny_llama, block_size=4, enable_prefix_caching=False)
    params = SamplingParams(temperature=0, max_tokens=4)
    for _ in range(2):
        assert llm.generate({"prompt_token_ids": prompts[5]}, params, use_tqdm=False)[0].num_cached_tokens == 0
    assert llm.kv_cache_stats()["prefix_cache_hits"] == 0


def test_eviction_under_memory_pressure_keeps_outputs_identical(tiny_llama, prompts):
    """Requests share a long few-shot prefix; the cache is too small to keep every block,
    so cached blocks are evicted (LRU) and reused while others still hit. Outputs equal an
    uncached run with ample memory."""
    prefix = prompts[5] + prompts[2]
    batch = [prefix + q for q in prompts[:6]] + [q + prefix for q in prompts[6:]]
    ample = make_llm(tiny_llama, block_size=4, enable_prefix_caching=False)
    expected = greedy_tokens(ample, batch, max_tokens=12)
    llm = make_llm(tiny_llama, block_size=4, num_gpu_blocks_override=40, max_num_seqs=3)
    for _ in range(2):
        assert greedy_tokens(llm, batch, max_tokens=12) == expected
    stats = llm.kv_cache_stats()
    assert 0 < stats["prefix_cache_hits"] < stats["prefix_cache_queries"]
    assert stats["num_evicted_blocks"] > 0
    assert_no_blocks_held(llm)
