"""Partial blocks in the prefix cache (enable_partial_block_caching): a sequence's last, partly
computed block stays cached when it ends, and a later prompt that continues its tokens (a chat's
next turn) takes it over; through the pool, the disk tier, and against transformers' tokens."""
import random

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.kv.block_pool import block_key, partial_block_key
from pagedserve.kv.kv_cache_manager import KVCacheManager
from pagedserve.kv.tier import TierIndex
from tests.conftest import hf_greedy

B = 4
HISTORY = list(range(100, 111))    # 2 full blocks, then 3 tokens; the last one sampled, never computed
COMPUTED = 10


def finished(kv: KVCacheManager, seq_id: int = 1, salt: str | None = None) -> int:
    """A sequence that computed HISTORY's first 10 tokens and ended: returns its block 2's id."""
    kv.allocate(seq_id, HISTORY, 0, 0, cache_salt=salt)
    kv.allocate(seq_id, HISTORY, 0, COMPUTED)
    block = kv.block_ids(seq_id)[2]
    kv.free(seq_id, HISTORY, COMPUTED)
    return block


def test_a_prompt_that_continues_the_tokens_takes_the_partial_block_over():
    kv = KVCacheManager(num_blocks=8, block_size=B, partial_blocks=True)
    block = finished(kv)
    key = partial_block_key(block_key(block_key(None, HISTORY[:4]), HISTORY[4:8]), [108, 109])
    assert kv.pool.cached[key].block_id == block and kv.pool.blocks[block].ref_cnt == 0
    prompt = HISTORY + [7, 8]                              # the next turn
    assert kv.admit(2, prompt, 32) == COMPUTED
    assert kv.block_ids(2)[2] == block                      # the same block, now the sequence's own
    taken = kv.pool.blocks[block]
    assert taken.ref_cnt == 1 and taken.key is None and key not in kv.pool.cached
    kv.check_invariants()
    assert kv.allocate(2, prompt, COMPUTED, 3) == []      # no copy: nobody else holds it
    full = block_key(kv.keys[2][1], prompt[8:12])          # it fills and is cached as a full block
    assert taken.key == full
    kv.check_invariants()
    kv.free(2, prompt, 13)
    kv.check_invariants()


def test_a_greedy_prompt_under_auto_takes_a_partial_block_only_if_batch_invariant_steps_computed_it():
    """(batch_invariant auto, issue 51.) A partial block left by a sequence whose last block a step
    of sampled requests only computed is not taken by a greedy request's admission (invariant_only);
    a sampled one takes it, and the block it fills stays batch-dependent."""
    kv = KVCacheManager(num_blocks=8, block_size=B, partial_blocks=True)
    kv.allocate(1, HISTORY, 0, 8)
    kv.allocate(1, HISTORY, 8, 2)
    kv.mark_batch_dependent([(1, 8)])
    kv.free(1, HISTORY, COMPUTED)
    prompt = HISTORY + [7, 8]
    assert kv.admit(2, prompt, 32, invariant_only=True) == 8    # the full blocks, not the partial one
    assert kv.admit(3, prompt, 32) == COMPUTED
    kv.allocate(3, prompt, COMPUTED, 3)
    assert not kv.tables[3][2].batch_invariant and kv.lookup_prefix(prompt + [9], invariant_only=True) == \
        kv.tables[3][:2]
    kv.check_invariants()


@pytest.mark.parametrize("prompt,salt,hit", [
    (HISTORY[:9] + [5, 6, 7], None, 8),        # differs in the partial block's tokens
    (HISTORY[:10], None, 8),                   # its last token would be a hit: always computed
    (HISTORY + [7], "tenant", 0),              # another salt
], ids=["other-tokens", "last-token", "salted"])
def test_only_a_prompt_with_all_its_tokens_under_its_salt_takes_it(prompt, salt, hit):
    kv = KVCacheManager(num_blocks=8, block_size=B, partial_blocks=True)
    block = finished(kv)
    assert kv.admit(2, prompt, 32, cache_salt=salt) == hit
    assert block not in kv.block_ids(2) and kv.pool.blocks[block].key is not None
    kv.check_invariants()


def test_salted_partial_blocks_stay_under_their_salt():
    kv = KVCacheManager(num_blocks=8, block_size=B, partial_blocks=True)
    finished(kv, salt="tenant")
    assert kv.admit(2, HISTORY + [7], 32) == 0
    assert kv.admit(3, HISTORY + [7], 32, cache_salt="tenant") == COMPUTED
    kv.check_invariants()


def test_off_by_default_and_never_for_a_shared_block():
    kv = KVCacheManager(num_blocks=8, block_size=B)
    finished(kv)
    assert kv.admit(2, HISTORY + [7], 32) == 8
    kv = KVCacheManager(num_blocks=8, block_size=B, partial_blocks=True)
    kv.allocate(1, HISTORY, 0, COMPUTED)
    kv.fork(1, 2)                                          # block 2 shared: not cached while the fork holds it
    kv.free(1, HISTORY, COMPUTED)
    assert len(kv.pool.cached) == 2
    kv.free(2, HISTORY, COMPUTED)                          # the last holder keeps it
    assert len(kv.pool.cached) == 3
    assert kv.admit(3, HISTORY + [7], 32) == COMPUTED
    kv.check_invariants()


def test_an_evicted_partial_block_goes_to_the_tier_and_comes_back():
    index = TierIndex(64)
    kv = KVCacheManager(num_blocks=4, block_size=B, tier=index, partial_blocks=True)
    block = finished(kv)
    key = kv.pool.blocks[block].key
    kv.allocate(9, list(range(16)), 0, 16)                 # the whole pool: every cached block evicted
    saves, _, _ = kv.tier.take()
    assert (block, key) in saves and key in index
    kv.free(9)
    assert kv.tier_fetch("r", HISTORY + [7], None, 0)
    _, loads, _ = kv.tier.take()
    assert [k for k, _ in loads][-1] == key and len(loads) == 3
    kv.tier.finished([k for k, _ in loads], [])
    assert kv.tier.lend("r")                              # held until admission, lent to its lookup
    assert kv.admit(2, HISTORY + [7], 32) == COMPUTED
    assert kv.block_ids(2)[2] == dict((k, b) for k, b in loads)[key]
    kv.check_invariants()


# ---- end to end, against transformers ------------------------------------------------------
def chat(llm, sessions, turns, answer=6):
    """Each session's turns round robin: the history plus a new user message, greedy."""
    sp = SamplingParams(temperature=0, max_tokens=answer, ignore_eos=True, logprobs=0)
    outs = []
    for turn in range(turns):
        for s in sessions:
            prompt = s["history"] + s["users"][turn]
            out = llm.generate({"prompt_token_ids": prompt}, sp, use_tqdm=False)[0]
            s["history"] = prompt + list(out.outputs[0].token_ids)
            lps = [lp[t].logprob for lp, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)]
            outs.append((prompt, list(out.outputs[0].token_ids), out.num_cached_tokens, lps))
    return outs


@pytest.mark.parametrize("tier", [False, True], ids=["pool", "tier"])
def test_chat_turns_take_the_last_answers_block_and_match_transformers(tiny_llama, tmp_path, tier):
    rng = random.Random(7)
    V = len(tiny_llama.tokenizer)
    sessions = [dict(history=[rng.randrange(3, V) for _ in range(40)],
                     users=[[rng.randrange(3, V) for _ in range(8)] for _ in range(2)]) for _ in range(3 if tier else 1)]
    ref = chat(LLM(tiny_llama.path, dtype="float32", num_gpu_blocks_override=64), [dict(s) for s in sessions], 2)
    kw = dict(kv_offload_path=str(tmp_path), num_gpu_blocks_override=8) if tier else dict(num_gpu_blocks_override=64)
    llm = LLM(tiny_llama.path, dtype="float32", enable_partial_block_caching=True, check_invariants=True, **kw)
    outs = chat(llm, sessions, 2)
    for (prompt, tokens, _, lps), (_, _, _, ref_lps) in zip(outs, ref):
        assert tokens == hf_greedy(tiny_llama.hf, prompt, 6)
        assert lps == pytest.approx(ref_lps, abs=1e-4)    # the taken block's KV is what recomputing gives
    # Turn 2 found turn 1's 48 prompt tokens and 5 computed answer tokens: 3 full blocks and 5 of the
    # fourth (the answer's last token has no KV yet).
    assert [out[2] for out in outs[len(sessions):]] == [53] * len(sessions)
    if tier:                 # three sessions in 8 blocks: each history came back from the tier
        stats = llm.kv_cache_stats()
        assert stats["kv_offload_blocks_loaded"] >= 2 * 4 and stats["kv_offload_load_failures"] == 0
        llm.shutdown()
