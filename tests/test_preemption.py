"""Preemption end to end: with KV memory for only a few requests, hundreds of preemptions
(recompute or swap) leave every greedy output, parallel sample and beam unchanged, and
neither pool leaks.

Every engine here checks the paging invariants (device and host pools) after each step.
"""
import logging

import pytest
import torch

from pagedserve import BeamSearchParams, SamplingParams
from pagedserve.worker.model_runner import kv_cache_bytes_per_block
from tests.conftest import PROMPTS
from tests.test_engine import assert_no_blocks_held, make_llm

BLOCK_SIZE = 2
TIGHT_BLOCKS = 40          # ~80 tokens of KV: two or three requests at a time
MAX_TOKENS = 24
ROUNDS = 6


@pytest.fixture(scope="module")
def prompts(tiny_llama):
    return [tiny_llama.tokenizer.encode(p) for p in PROMPTS]


def run_mix(llm, prompts) -> tuple[list, set[str]]:
    """Greedy single sequences, greedy n=2 and beam search (width 2), all submitted at once.
    Returns every output and the kinds of request (g, n, b) that were preempted."""
    engine = llm.engine
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    pair = SamplingParams(n=2, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    beam = BeamSearchParams(beam_width=2, max_tokens=MAX_TOKENS // 2, ignore_eos=True)
    reqs = []
    for r in range(ROUNDS):   # each round's prompts start differently, so only some prefixes are shared
        ps = [[7 + r] + p for p in prompts]
        reqs += [engine.add_request(f"g{r}.{i}", {"prompt_token_ids": p}, greedy) for i, p in enumerate(ps)]
        reqs += [engine.add_request(f"n{r}.{i}", {"prompt_token_ids": p}, pair) for i, p in enumerate(ps[:4])]
        reqs += [engine.add_request(f"b{r}.{i}", {"prompt_token_ids": p}, beam) for i, p in enumerate(ps[4:7])]
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = [c.token_ids for c in out.outputs]
    outputs = [finals[r.request_id] if not r.is_beam_search else
               [s.tokens for s in engine.beam_search_output(r).sequences] for r in reqs]
    return outputs, {r.request_id[0] for r in reqs if r.num_preemptions}


def host_bytes(tm, num_blocks: int) -> int:
    a = tm.hf.config
    head_dim = a.hidden_size // a.num_attention_heads
    return num_blocks * kv_cache_bytes_per_block(a.num_hidden_layers, BLOCK_SIZE, a.num_key_value_heads, head_dim,
                                                 torch.float32)


@pytest.fixture(scope="module")
def ample(tiny_llama, prompts):
    llm = make_llm(tiny_llama, block_size=BLOCK_SIZE, num_gpu_blocks_override=2048)
    outs, preempted = run_mix(llm, prompts)
    assert not preempted and llm.kv_cache_stats()["num_preemptions"] == 0
    return outs


@pytest.mark.parametrize("mode,host_blocks", [("recompute", 0), ("swap", 64), ("swap", 6)])
def test_hundreds_of_preemptions_change_no_output(tiny_llama, prompts, ample, mode, host_blocks):
    """swap with 6 host blocks: swap space runs out, so some preemptions fall back to recompute."""
    kw = dict(preemption_mode=mode)
    if mode == "swap":
        kw["swap_space"] = host_bytes(tiny_llama, host_blocks) / 1024**3   # GiB
    llm = make_llm(tiny_llama, block_size=BLOCK_SIZE, num_gpu_blocks_override=TIGHT_BLOCKS, **kw)
    outs, preempted = run_mix(llm, prompts)
    assert outs == ample
    assert preempted == {"g", "n", "b"}     # single, parallel and beam requests were all preempted
    stats = llm.kv_cache_stats()
    assert stats["num_preemptions"] >= 100
    if mode == "recompute":
        assert stats["num_swapped_out_blocks"] == 0 and stats["num_recomputed_tokens"] > 0
    else:
        assert stats["num_host_blocks"] == host_blocks
        assert stats["num_swapped_out_blocks"] > 0
        assert stats["num_swapped_in_blocks"] == stats["num_swapped_out_blocks"]
        # With room for any group in swap space nothing is recomputed; with 6 blocks some is.
        assert (stats["num_recomputed_tokens"] == 0) == (host_blocks == 64)
    assert stats["num_free_host_blocks"] == stats["num_host_blocks"]
    assert_no_blocks_held(llm)


def test_preemption_warns_once(tiny_llama, prompts, caplog):
    llm = make_llm(tiny_llama, block_size=BLOCK_SIZE, num_gpu_blocks_override=TIGHT_BLOCKS)
    with caplog.at_level(logging.WARNING, logger="pagedserve.scheduler"):
        llm.generate([{"prompt_token_ids": p} for p in prompts],
                     SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    warnings = [r for r in caplog.records if "preempted" in r.getMessage()]
    assert llm.kv_cache_stats()["num_preemptions"] > 1 and len(warnings) == 1
    assert "kv_cache_memory" in warnings[0].getMessage()


def test_aborting_swapped_requests_frees_both_pools(tiny_llama, prompts):
    llm = make_llm(tiny_llama, block_size=BLOCK_SIZE, num_gpu_blocks_override=TIGHT_BLOCKS,
                   preemption_mode="swap", swap_space=host_bytes(tiny_llama, 64) / 1024**3)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    while not engine.scheduler.swapped:
        engine.step()
    for req in list(engine.scheduler.swapped):
        engine.abort_request(req.request_id)
    while engine.has_unfinished_requests():
        engine.step()
    assert_no_blocks_held(llm)
    assert llm.kv_cache_stats()["num_free_host_blocks"] == 64


def test_swap_needs_swap_space(tiny_llama):
    with pytest.raises(ValueError, match="preemption_mode='swap' needs swap_space"):
        make_llm(tiny_llama, preemption_mode="swap")
    with pytest.raises(ValueError, match="swap_space must be >= 0"):
        make_llm(tiny_llama, preemption_mode="swap", swap_space=-1)
    with pytest.raises(ValueError, match="preemption_mode must be"):
        make_llm(tiny_llama, preemption_mode="evict")
    with pytest.raises(ValueError, match="preemption_mode='swap' needs kv_allocator='paged'"):
        make_llm(tiny_llama, preemption_mode="swap", swap_space=0.001, kv_allocator="max")


def test_a_group_preempted_right_after_forking_comes_back(tiny_llama):
    """Issue 19 through the engine: the n=3 request is preempted by recompute in the step it
    forks; re-admitting it finds its whole prompt in the prefix cache and rejoins its
    followers, but the blocks for their last tokens are short, so admission fails. That
    failure used to leave three sequences no longer sharing their prompt, needing more
    blocks than the cache has: the engine spun forever."""
    llm = make_llm(tiny_llama, block_size=1, num_gpu_blocks_override=24, max_num_batched_tokens=33, max_num_seqs=4)
    outs = llm.generate([{"prompt_token_ids": [3] * 7}, {"prompt_token_ids": [4] * 15}],
                        [SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True),
                         SamplingParams(n=3, max_tokens=1, temperature=1.0, ignore_eos=True)], use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) == 12
    assert [len(c.token_ids) for c in outs[1].outputs] == [1, 1, 1]
    assert llm.kv_cache_stats()["num_preemptions"] >= 1
    assert_no_blocks_held(llm)
