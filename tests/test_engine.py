"""The engine end to end on a tiny model: batch invariance, sampling features, bad input.

Every engine here checks the paging invariants after each step (conftest sets
PAGEDSERVE_CHECK_INVARIANTS), and each test ends by checking no block is held.
"""
import pytest
import torch

from pagedserve import LLM, SamplingParams
from tests.conftest import PROMPTS, hf_greedy


def make_llm(tm, **kw):
    kw.setdefault("dtype", "float32")
    kw.setdefault("num_gpu_blocks_override", 256)
    return LLM(tm.path, **kw)


def assert_no_blocks_held(llm):
    stats = llm.kv_cache_stats()
    assert stats["num_used_blocks"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]
    llm.engine.check_paging_invariants()


def greedy_tokens(llm, prompts, max_tokens=20):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def prompts(tiny_llama):
    return [tiny_llama.tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def alone(tiny_llama, prompts):
    """Each prompt generated on its own: the reference for batch invariance."""
    llm = make_llm(tiny_llama)
    return [greedy_tokens(llm, [p])[0] for p in prompts]


@pytest.mark.parametrize("block_size,budget", [(1, 2048), (16, 2048), (32, 2048), (16, 7), (1, 5), (32, 16)])
def test_batch_invariance(tiny_llama, prompts, alone, block_size, budget):
    llm = make_llm(tiny_llama, block_size=block_size, max_num_batched_tokens=budget, max_num_seqs=budget,
                   num_gpu_blocks_override=4096 // block_size)
    assert greedy_tokens(llm, prompts) == alone
    assert_no_blocks_held(llm)


def test_greedy_equals_transformers_with_ignore_eos(tiny_llama, prompts):
    """ignore_eos keeps generating through EOS: compare with transformers up to its first EOS."""
    llm = make_llm(tiny_llama)
    ours = greedy_tokens(llm, prompts[:4], max_tokens=16)
    eos = tiny_llama.tokenizer.eos_token_id
    for p, toks in zip(prompts, ours):
        with torch.no_grad():
            ref = tiny_llama.hf.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False,
                                         pad_token_id=eos)[0, len(p):].tolist()
        n = ref.index(eos) + 1 if eos in ref else len(ref)
        assert toks[:n] == ref[:n]


def test_requests_join_while_others_run(tiny_llama, prompts, alone):
    llm = make_llm(tiny_llama, max_num_batched_tokens=16, max_num_seqs=16)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    results = {}
    pending = list(enumerate(prompts))
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % 3 == 0:   # a new request every third step
            i, p = pending.pop(0)
            engine.add_request(str(i), {"prompt_token_ids": p}, params)
        for out in engine.step():
            if out.finished:
                results[int(out.request_id)] = out.outputs[0].token_ids
        step += 1
    assert [results[i] for i in range(len(prompts))] == alone
    assert_no_blocks_held(llm)


def test_seeded_sampling_is_reproducible_across_batches(tiny_llama, prompts):
    llm = make_llm(tiny_llama)
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=16, seed=1234, ignore_eos=True)
    alone = llm.generate({"prompt_token_ids": prompts[0]}, params, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)
    batch = llm.generate([{"prompt_token_ids": p} for p in prompts[1:4]] + [{"prompt_token_ids": prompts[0]}],
                         [others] * 3 + [params], use_tqdm=False)
    assert batch[-1].outputs[0].token_ids == alone
    different = llm.generate({"prompt_token_ids": prompts[0]}, SamplingParams(
        temperature=1.0, top_p=0.9, top_k=50, max_tokens=16, seed=99, ignore_eos=True), use_tqdm=False)
    assert different[0].outputs[0].token_ids != alone
    assert_no_blocks_held(llm)


def test_max_tokens_min_tokens_and_stop_token_ids(tiny_llama, prompts):
    llm = make_llm(tiny_llama)
    p = {"prompt_token_ids": prompts[2]}
    free = llm.generate(p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    toks = free.outputs[0].token_ids
    assert len(toks) == 12 and free.outputs[0].finish_reason == "length"
    # Stop at the first occurrence of the 4th token's id; it is kept in the output ids.
    stop_id = toks[3]
    first = toks.index(stop_id)
    out = llm.generate(p, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_id], ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == toks[:first + 1] and out.finish_reason == "stop" and out.stop_reason == stop_id
    # min_tokens keeps going past the stop id until enough tokens exist.
    out = llm.generate(p, SamplingParams(temperature=0, max_tokens=12, min_tokens=first + 1,
                                         stop_token_ids=[stop_id], ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) > first + 1
    assert_no_blocks_held(llm)


def test_stop_strings(tiny_llama, prompts):
    llm = make_llm(tiny_llama)
    p = {"prompt_token_ids": prompts[0]}
    full = llm.generate(p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True), use_tqdm=False)[0]
    text = full.outputs[0].text
    assert len(text) > 6
    stop = text[3:6]
    idx = text.index(stop)
    out = llm.generate(p, SamplingParams(temperature=0, max_tokens=24, stop=[stop], ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert out.text == text[:idx] and out.finish_reason == "stop" and out.stop_reason == stop
    out = llm.generate(p, SamplingParams(temperature=0, max_tokens=24, stop=stop, ignore_eos=True,
                                         include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert out.text == text[:idx + len(stop)]
    assert_no_blocks_held(llm)


def test_a_stop_string_on_the_last_token_outranks_the_length_limit(tiny_llama, prompts):
    """The output side checks stop strings after the scheduler has ended the sequence by length
    on the same token: "stop" with the string wins, as when the scheduler checked it."""
    llm = make_llm(tiny_llama)
    p = {"prompt_token_ids": prompts[1]}
    greedy = dict(temperature=0, ignore_eos=True)
    before = llm.generate(p, SamplingParams(max_tokens=7, **greedy), use_tqdm=False)[0].outputs[0].text
    full = llm.generate(p, SamplingParams(max_tokens=8, **greedy), use_tqdm=False)[0].outputs[0].text
    assert len(full) > len(before)
    start = next(i for i in range(len(before) - 1, -1, -1) if full.find(full[i:]) == i)
    out = llm.generate(p, SamplingParams(max_tokens=8, stop=[full[start:]], **greedy), use_tqdm=False)[0].outputs[0]
    assert (out.finish_reason, out.stop_reason, out.text) == ("stop", full[start:], full[:start])
    assert len(out.token_ids) == 8
    assert_no_blocks_held(llm)


def test_parallel_samples_each_stop_on_their_own_text(tiny_llama, prompts):
    """Forked sequences get their text on the output side (caught up from the prompt): each
    sample's text is its own tokens' text, cut at the stop string."""
    llm = make_llm(tiny_llama)
    p = {"prompt_token_ids": prompts[0]}
    free = llm.generate(p, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=16, ignore_eos=True),
                        use_tqdm=False)[0].outputs
    stop = free[0].text[2:4]
    outs = llm.generate(p, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=16, ignore_eos=True, stop=[stop]),
                        use_tqdm=False)[0].outputs
    for f, o in zip(free, outs):
        cut = f.text.find(stop)
        if cut == -1:
            assert (o.text, o.finish_reason) == (f.text, "length")
        else:
            assert (o.text, o.finish_reason, o.stop_reason) == (f.text[:cut], "stop", stop)
            assert o.token_ids == f.token_ids[:len(o.token_ids)]
    assert_no_blocks_held(llm)


def test_logprob_entries_carry_each_tokens_text(tiny_llama, prompts):
    """decoded_token is the token decoded alone (as vLLM's), sampled and prompt positions alike."""
    llm = make_llm(tiny_llama)
    tok = tiny_llama.tokenizer
    out = llm.generate({"prompt_token_ids": prompts[0]}, SamplingParams(temperature=0, max_tokens=5, logprobs=2,
                                                                         prompt_logprobs=1, ignore_eos=True),
                       use_tqdm=False)[0]
    positions = out.outputs[0].logprobs + [p for p in out.prompt_logprobs if p is not None]
    assert len(positions) == 5 + len(prompts[0]) - 1
    for pos in positions:
        for t, lp in pos.items():
            assert lp.decoded_token == tok.decode([t])


def test_incremental_text_equals_full_decode(tiny_llama, prompts):
    """Random tokens make broken UTF-8 too: text built token by token equals a decode of
    all tokens at once, except that bytes still waiting for the rest of their character
    at the very end are not shown."""
    llm = make_llm(tiny_llama)
    tok = tiny_llama.tokenizer
    for p in prompts:
        out = llm.generate({"prompt_token_ids": p}, SamplingParams(temperature=0.9, seed=3, max_tokens=30,
                                                                   ignore_eos=True), use_tqdm=False)[0].outputs[0]
        full = tok.decode(out.token_ids, skip_special_tokens=True)
        assert out.text.rstrip("\ufffd") == full.rstrip("\ufffd")


def test_detokenizer_keeps_multibyte_characters_whole(tiny_tokenizer):
    from pagedserve.engine.detokenizer import IncrementalDetokenizer
    text = " Héllo wörld, 日本語のテキスト 🙂🚀 ñ"
    ids = tiny_tokenizer.encode(text)
    prompt = tiny_tokenizer.encode("Once upon a time")
    detok = IncrementalDetokenizer(tiny_tokenizer.backend_tokenizer, prompt, True, [], False)
    seen = []
    for t in ids:
        detok.add_token(t, check_stop=True)
        seen.append(detok.text)
        assert "\ufffd" not in detok.text
    assert detok.text == text


def test_logprobs_match_transformers(tiny_llama, prompts):
    llm = make_llm(tiny_llama)
    p = prompts[1]
    out = llm.generate({"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=6, logprobs=3,
                                                               prompt_logprobs=2, ignore_eos=True),
                       use_tqdm=False)[0]
    comp = out.outputs[0]
    full = p + comp.token_ids
    with torch.no_grad():
        ref = torch.log_softmax(tiny_llama.hf(torch.tensor([full])).logits[0].double(), -1)
    for i, (tok, lps) in enumerate(zip(comp.token_ids, comp.logprobs)):
        row = ref[len(p) - 1 + i]
        assert lps[tok].rank == 1                       # greedy picks the top token
        assert abs(lps[tok].logprob - row[tok].item()) < 1e-4
        top = row.topk(3).indices.tolist()
        assert set(top) <= set(lps)
    assert comp.cumulative_logprob == pytest.approx(sum(lp[t].logprob for t, lp in zip(comp.token_ids, comp.logprobs)))
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(p)
    for pos in range(1, len(p)):
        entry = out.prompt_logprobs[pos]
        assert abs(entry[p[pos]].logprob - ref[pos - 1, p[pos]].item()) < 1e-4
        assert len(entry) <= 3


def test_penalties_change_output_and_follow_the_formula(tiny_llama, prompts):
    llm = make_llm(tiny_llama)
    p = {"prompt_token_ids": prompts[6]}
    plain = llm.generate(p, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), use_tqdm=False)
    rep = llm.generate(p, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, frequency_penalty=2.0,
                                         presence_penalty=2.0, repetition_penalty=1.5), use_tqdm=False)
    a, b = plain[0].outputs[0].token_ids, rep[0].outputs[0].token_ids
    assert len(set(b)) >= len(set(a))
    assert a != b


def test_bad_input_is_refused_and_leaves_nothing_allocated(tiny_llama, prompts):
    llm = make_llm(tiny_llama, max_model_len=64)
    with pytest.raises(ValueError, match="prompt is 80 tokens.*maximum context length is 64"):
        llm.generate([{"prompt_token_ids": prompts[0]}, {"prompt_token_ids": [5] * 80}], use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate("", use_tqdm=False)
    with pytest.raises(ValueError, match="out of vocabulary"):
        llm.generate({"prompt_token_ids": [1, 10**6]}, use_tqdm=False)
    assert_no_blocks_held(llm)
    assert not llm.engine.has_unfinished_requests()
    # And the engine still serves.
    assert len(llm.generate({"prompt_token_ids": prompts[0]}, use_tqdm=False)[0].outputs[0].token_ids) > 0


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=-0.1), "temperature must be >= 0"),
    (dict(top_p=0.0), "top_p must be in \\(0, 1\\]"),
    (dict(top_p=1.5), "top_p must be in \\(0, 1\\]"),
    (dict(max_tokens=0), "max_tokens must be an integer >= 1"),
    (dict(n=0), "n must be an integer >= 1"),
    (dict(n=2, best_of=1), "best_of must be an integer >= n"),
    (dict(top_k=-5), "top_k"),
    (dict(min_p=2.0), "min_p must be in \\[0, 1\\]"),
    (dict(logprobs=-1), "logprobs must be an integer >= 0"),
    (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"),
])
def test_invalid_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_max_tokens_is_capped_by_the_context(tiny_llama, prompts):
    llm = make_llm(tiny_llama, max_model_len=32)
    p = prompts[5][:20]
    out = llm.generate({"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 12 and out.finish_reason == "length"


def test_chat_uses_the_template(tiny_llama):
    llm = make_llm(tiny_llama)
    out = llm.chat([{"role": "user", "content": "hello"}], SamplingParams(temperature=0, max_tokens=5),
                   use_tqdm=False)[0]
    expected = tiny_llama.tokenizer.apply_chat_template([{"role": "user", "content": "hello"}],
                                                        add_generation_prompt=True, tokenize=False)
    assert tiny_llama.tokenizer.decode(out.prompt_token_ids) == expected
    with pytest.raises(ValueError, match="role"):
        llm.chat([{"role": "wizard", "content": "x"}], use_tqdm=False)


def test_tiny_kv_budget_still_finishes_everything(tiny_llama, prompts, alone):
    """With only a few blocks requests are preempted and recomputed; outputs do not change."""
    llm = make_llm(tiny_llama, block_size=4, num_gpu_blocks_override=24)
    assert greedy_tokens(llm, prompts) == alone
    assert llm.kv_cache_stats()["num_preemptions"] > 0
    assert_no_blocks_held(llm)
