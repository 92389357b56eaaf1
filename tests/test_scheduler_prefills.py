"""Short prefills beside long ones (vLLM's long_prefill_token_threshold, max_num_partial_prefills,
max_long_partial_prefills): a prompt that is mostly a prefix-cache hit, or short, is not queued
behind another request's long prefill. Fixed step orders, no model, no timing."""
import pytest

from pagedserve.config import EngineConfig
from tests.test_scheduler import add, fake_step, make_scheduler, run_all


def steps(out) -> list[tuple[str, int]]:
    return [(s.request.request_id, s.num_new_tokens) for s in out.scheduled]


def test_without_a_threshold_a_long_prefill_takes_the_whole_budget():
    sched = make_scheduler(max_num_batched_tokens=16)
    add(sched, "a", 60, 2)
    assert steps(fake_step(sched)) == [("a", 16)]
    add(sched, "b", 5, 2)
    assert steps(fake_step(sched)) == [("a", 16)]          # b waits behind a's chunks
    run_all(sched)


def test_a_long_prefill_computes_at_most_the_threshold_a_step_so_a_short_one_runs_beside_it():
    sched = make_scheduler(max_num_batched_tokens=16, long_prefill_token_threshold=8)
    add(sched, "a", 60, 2)
    assert steps(fake_step(sched)) == [("a", 8)]
    b = add(sched, "b", 5, 2)
    out = fake_step(sched)
    assert steps(out) == [("a", 8), ("b", 5)] and b.seqs[0].num_output_tokens == 1
    run_all(sched)


def test_a_long_prompt_waits_for_a_long_slot_while_a_short_one_passes_it():
    """a and c are long (20 tokens, threshold 4); b is short. With one long slot, c keeps its place
    in the queue while b is admitted past it, and starts in the first step that begins with a's
    prompt no longer long (4 tokens left: step 5); with two slots, at once."""
    for max_long in (1, 2):
        sched = make_scheduler(max_num_batched_tokens=32, long_prefill_token_threshold=4,
                               max_long_partial_prefills=max_long)
        a, c, _ = add(sched, "a", 20, 3), add(sched, "c", 20, 3), add(sched, "b", 3, 3)
        out = fake_step(sched)
        if max_long == 2:
            assert steps(out) == [("a", 4), ("c", 4), ("b", 3)]
            run_all(sched)
            continue
        assert steps(out) == [("a", 4), ("b", 3)] and list(sched.waiting) == [c]
        step = 1
        while True:
            left = a.seqs[0].num_tokens - a.seqs[0].num_computed_tokens
            step += 1
            out = fake_step(sched)
            if any(s.request is c for s in out.scheduled):
                break
            assert left > 4 and list(sched.waiting) == [c]
        assert step == 5 and left == 4 and steps(out)[-1] == ("c", 4)
        run_all(sched)


def test_a_prompt_mostly_in_the_prefix_cache_is_short():
    """d's 42 tokens are 40 cached ones (another request's) and 2 new: it is admitted beside the
    long prefill a although the one long slot is taken; c (long) waits."""
    sched = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=8, enable_prefix_caching=True)
    shared = list(range(100, 140))
    add(sched, "p", 40, 1, prompt=shared)
    run_all(sched)
    a = add(sched, "a", 40, 2, prompt=list(range(200, 240)))
    c = add(sched, "c", 40, 2, prompt=list(range(300, 340)))
    d = add(sched, "d", 42, 2, prompt=shared + [1, 2])
    assert steps(fake_step(sched)) == [("a", 8), ("d", 2)]
    assert d.num_cached_tokens == 40 and list(sched.waiting) == [c] and a.status.name == "RUNNING"
    run_all(sched)


def test_at_most_max_num_partial_prefills_prompts_in_progress():
    sched = make_scheduler(max_num_batched_tokens=32, long_prefill_token_threshold=8, max_num_partial_prefills=1)
    a, b = add(sched, "a", 12, 2), add(sched, "b", 3, 2)
    assert steps(fake_step(sched)) == [("a", 8)]
    assert steps(fake_step(sched)) == [("a", 4)]            # a samples: decoding from the next step
    assert steps(fake_step(sched)) == [("a", 1), ("b", 3)]
    assert b.seqs[0].num_output_tokens == 1
    run_all(sched)


@pytest.mark.parametrize("kw,field", [
    (dict(long_prefill_token_threshold=-1), "long_prefill_token_threshold"),
    (dict(max_long_partial_prefills=0), "max_long_partial_prefills"),
    (dict(max_num_partial_prefills=-1), "max_num_partial_prefills"),
    (dict(max_num_partial_prefills=1, max_long_partial_prefills=2), "max_long_partial_prefills"),
])
def test_settings_are_checked(kw, field):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**kw)


def test_a_waiting_prompt_is_looked_up_once_a_step_with_a_threshold(monkeypatch):
    """With long_prefill_token_threshold set, the lookup that classifies a waiting prompt (long or
    short) is the one it is admitted with: its block keys are hashed once, not again in _admit;
    and the admitted request holds the same cached tokens as without a threshold."""
    from pagedserve.kv import kv_cache_manager
    calls = []
    real = kv_cache_manager.lookup_block_keys
    monkeypatch.setattr(kv_cache_manager, "lookup_block_keys", lambda *a, **k: calls.append(1) or real(*a, **k))
    for threshold in (0, 8):
        sched = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=threshold,
                               enable_prefix_caching=True)
        a = add(sched, "a", 40, 2, prompt=list(range(100, 140)))
        run_all(sched)
        d = add(sched, "d", 0, 2, prompt=a.prompt_token_ids + [7, 8])
        calls.clear()
        out = fake_step(sched)
        assert steps(out) == [("d", 2)] and d.num_cached_tokens == 40, threshold
        assert len(calls) == 1, threshold
        run_all(sched)
