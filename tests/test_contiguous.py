"""Contiguous-reservation baselines (max, pow2, oracle) and the memory-waste accounting.

The allocators are tested on their own (placement, fragmentation, freeing), the
waste accounting against hand-computed cases, the scheduler on top of them without
a model, and the engine end to end: every allocator gives the paged engine's
greedy tokens, only the capacity differs.
"""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve import LLM, SamplingParams
from pagedserve.config import EngineConfig
from pagedserve.kv.block_pool import NoFreeBlocksError
from pagedserve.kv.contiguous import ContiguousKVCacheManager, RegionAllocator
from pagedserve.kv.fit import next_pow2
from pagedserve.kv.kv_cache_manager import KVCacheManager
from pagedserve.kv.memory_usage import MemoryUsage
from pagedserve.sampling_params import BeamSearchParams
from pagedserve.scheduler import Scheduler
from tests.conftest import PROMPTS, examples
from tests.test_scheduler import add, fake_step, run_all

# ---- the region allocator ------------------------------------------------------------------


def test_first_fit_places_regions_in_the_first_hole_that_holds_them():
    pool = RegionAllocator(10)
    assert [pool.allocate(n) for n in (4, 2, 3)] == [0, 4, 6]     # holes: [9, 1]
    pool.free(4, 2)                                                # holes: [4, 2], [9, 1]
    assert pool.holes == [[4, 2], [9, 1]] and pool.num_free_blocks == 3
    with pytest.raises(NoFreeBlocksError, match="no hole of 3 contiguous blocks.*3 free, largest hole 2"):
        pool.allocate(3)                                           # external fragmentation
    assert pool.allocate(1) == 4                                   # first fit, not the exact fit at 9
    assert pool.holes == [[5, 1], [9, 1]]
    pool.check()


def test_freeing_merges_neighbouring_holes():
    pool = RegionAllocator(12)
    starts = [pool.allocate(3) for _ in range(4)]                  # 0, 3, 6, 9: full
    assert starts == [0, 3, 6, 9] and pool.holes == []
    pool.free(3, 3)
    pool.free(9, 3)
    assert pool.holes == [[3, 3], [9, 3]]
    pool.free(6, 3)                                                # joins both neighbours
    assert pool.holes == [[3, 9]]
    pool.free(0, 3)
    assert pool.holes == [[0, 12]] and pool.num_free_blocks == 12
    pool.check()
    with pytest.raises(AssertionError, match="overlap"):
        pool.free(2, 2)


@pytest.mark.fuzz
@settings(max_examples=examples(50))
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(1, 6)), max_size=40))
def test_allocator_keeps_holes_and_regions_tiling_the_space(ops):
    pool = RegionAllocator(20)
    regions: list[tuple[int, int]] = []
    for alloc, n in ops:
        if alloc or not regions:
            fits = pool.find(n) is not None
            assert fits == (pool.largest_hole >= n)
            if fits:
                regions.append((pool.allocate(n), n))
        else:
            pool.free(*regions.pop(n % len(regions)))
        pool.check()
        used = sorted(regions)
        assert all(a + n <= b for (a, n), (b, _) in zip(used, used[1:])), "regions overlap"
        assert pool.num_free_blocks == 20 - sum(n for _, n in regions)


# ---- reservation sizes and the manager interface -------------------------------------------

def test_reservation_sizes_per_policy():
    assert [next_pow2(n) for n in (1, 2, 3, 17, 64, 65)] == [1, 2, 4, 32, 64, 128]
    mk = lambda policy, bs=1: ContiguousKVCacheManager(256, bs, policy, max_model_len=100)  # noqa: E731
    assert mk("max").reservation_slots(7) == 100
    assert mk("pow2").reservation_slots(7) == 8
    assert mk("pow2").reservation_slots(70) == 100       # never past max_model_len
    assert mk("oracle").reservation_slots(7) == 7
    assert mk("oracle", bs=4).reservation_blocks(7) == 2   # whole blocks: 8 slots
    with pytest.raises(ValueError, match="give max_model_len"):
        ContiguousKVCacheManager(8, 1, "max", max_model_len=None)


def test_a_region_is_reserved_with_the_first_tokens_and_freed_whole():
    kv = ContiguousKVCacheManager(num_blocks=10, block_size=4, policy="oracle", max_model_len=40)
    kv.set_max_len(1, 10)                                 # 3 blocks
    assert kv.num_blocks_needed(1, 0, 0) == 0 and kv.allocate(1, [5] * 6, 0, 0) == []
    assert kv.block_ids(1) == []                          # nothing yet
    assert kv.num_blocks_needed(1, 0, 6) == 3 and kv.allocate(1, [5] * 6, 0, 6) == []
    assert kv.block_ids(1) == [0, 1, 2] and kv.num_free_blocks == 7
    assert kv.num_blocks_needed(1, 6, 1) == 0             # decoding needs nothing more
    kv.allocate(1, [5] * 7, 6, 1)
    kv.set_max_len(2, 4)
    kv.allocate(2, [5] * 4, 0, 4)
    assert kv.block_ids(2) == [3]                         # consecutive, right after
    kv.check_invariants()
    with pytest.raises(ValueError, match="cannot share"):
        kv.fork(1, 3)
    kv.free(1)
    kv.free(2)
    assert kv.num_free_blocks == 10 and kv.pool.holes == [[0, 10]] and not kv.tables
    kv.check_invariants()


def test_can_allocate_sees_fragmentation_that_counting_free_blocks_misses():
    kv = ContiguousKVCacheManager(num_blocks=12, block_size=1, policy="oracle", max_model_len=12)
    for seq_id in range(4):
        kv.set_max_len(seq_id, 3)
        kv.allocate(seq_id, [1] * 3, 0, 3)
    kv.free(0)
    kv.free(2)                                            # holes [0, 3] and [6, 3]
    kv.set_max_len(9, 5)
    assert kv.num_free_blocks == 6 and kv.num_blocks_needed(9, 0, 5) == 5
    assert not kv.can_allocate([(9, 0, 5)])
    kv.set_max_len(8, 3)
    assert kv.can_allocate([(8, 0, 3)])
    kv.set_max_len(7, 3)
    assert kv.can_allocate([(8, 0, 3), (7, 0, 3)]) and not kv.can_allocate([(8, 0, 3), (7, 0, 3), (9, 0, 5)])


def test_requests_that_need_sharing_or_too_much_room_are_refused():
    kv = ContiguousKVCacheManager(num_blocks=8, block_size=4, policy="max", max_model_len=64)
    with pytest.raises(ValueError, match="cannot share blocks.*kv_allocator='paged'"):
        kv.fit.check(4, 4, shares_blocks=True)
    with pytest.raises(ValueError, match="never fit.*'max' reserves 64 slots \\(16 blocks of 4\\).*has 8 blocks"):
        kv.fit.check(4, 4, shares_blocks=False)
    ContiguousKVCacheManager(8, 4, "oracle", 64).fit.check(4, 28, shares_blocks=False)   # 8 blocks: fits


# ---- memory-waste accounting: one hand-computed case per category --------------------------

def test_paged_usage_counts_the_last_blocks_tail():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False)
    kv.allocate(1, list(range(6)), 0, 6)                  # 6 tokens: 2 blocks, 8 slots
    usage = kv.memory_usage([(1, 6, 7)])                  # will end at 7 tokens
    assert usage == MemoryUsage(token_states=6, reserved=1, internal_fragmentation=1, free=24)
    kv.fork(1, 2)                                         # shared blocks count once
    assert kv.memory_usage([(1, 6, 7), (2, 6, 7)]) == usage
    # Paging never strands free space, whatever waits.
    assert kv.memory_usage([(1, 6, 7), (2, 6, 7)], waiting_max_len=1000).external_fragmentation == 0


@pytest.mark.parametrize("policy,block_size,expected", [
    # 6 tokens computed, final length 7, max_model_len 16
    ("oracle", 1, dict(token_states=6, reserved=1, internal_fragmentation=0)),   # exactly 7 slots
    ("oracle", 4, dict(token_states=6, reserved=1, internal_fragmentation=1)),   # 8: block rounding
    ("pow2", 1, dict(token_states=6, reserved=1, internal_fragmentation=1)),     # next_pow2(7) = 8
    ("max", 1, dict(token_states=6, reserved=1, internal_fragmentation=9)),      # 16
])
def test_contiguous_usage_per_policy(policy, block_size, expected):
    kv = ContiguousKVCacheManager(num_blocks=32 // block_size, block_size=block_size, policy=policy,
                                  max_model_len=16)
    kv.set_max_len(1, 7)
    kv.allocate(1, list(range(6)), 0, 6)
    usage = kv.memory_usage([(1, 6, 7)])
    held = sum(expected.values())
    assert usage == MemoryUsage(**expected, external_fragmentation=0, free=32 - held)


def test_external_fragmentation_is_free_space_stranded_by_holes():
    kv = ContiguousKVCacheManager(num_blocks=12, block_size=1, policy="oracle", max_model_len=12)
    for seq_id in range(4):
        kv.set_max_len(seq_id, 3)
        kv.allocate(seq_id, [1, 2], 0, 2)
    kv.free(0)
    kv.free(2)                                            # holes of 3 at 0 and 6
    seqs = [(1, 2, 3), (3, 2, 3)]
    held = dict(token_states=4, reserved=2, internal_fragmentation=0)
    # The waiting request needs 5: the 6 free slots would hold it, no hole does.
    assert kv.memory_usage(seqs, waiting_max_len=5) == MemoryUsage(**held, external_fragmentation=6, free=0)
    # It needs 7: more than is free at all, so not a matter of contiguity.
    assert kv.memory_usage(seqs, waiting_max_len=7) == MemoryUsage(**held, free=6)
    # It needs 3: a hole holds it; nothing waits: the space is just free.
    assert kv.memory_usage(seqs, waiting_max_len=3) == MemoryUsage(**held, free=6)
    assert kv.memory_usage(seqs) == MemoryUsage(**held, free=6)


def test_usage_sums_and_shares():
    a = MemoryUsage(token_states=3, reserved=1, free=4)
    b = MemoryUsage(internal_fragmentation=2, external_fragmentation=2)
    total = a + b
    assert total.total == 12 and total.shares()["token_states"] == 0.25 and total.shares()["free"] == 4 / 12


# ---- the scheduler on top (no model) --------------------------------------------------------

def make_scheduler(policy, num_blocks, block_size=1, max_model_len=32, **kw):
    kw.setdefault("max_num_seqs", min(256, kw.get("max_num_batched_tokens", 2048)))   # else refused
    cfg = EngineConfig(block_size=block_size, kv_allocator=policy, enable_prefix_caching=False, **kw)
    return Scheduler(cfg, num_blocks, max_model_len)


def test_reservations_admit_fewer_requests_and_never_preempt():
    sizes = {}
    for policy in ("paged", "max", "pow2", "oracle"):
        sched = make_scheduler(policy, num_blocks=64, max_model_len=32, max_num_batched_tokens=256)
        for i in range(8):
            add(sched, str(i), 5, 5)                      # 10 tokens each
        fake_step(sched)
        sizes[policy] = len(sched.running)
        run_all(sched)
        assert policy == "paged" or sched.stats.num_preemptions == 0
    # 64 slots: paging takes only the prompts' 5 slots; oracle reserves 10 per request,
    # pow2 16, max 32.
    assert sizes == {"paged": 8, "oracle": 6, "pow2": 4, "max": 2}


def test_a_request_waits_for_a_hole_although_enough_slots_are_free():
    sched = make_scheduler("oracle", num_blocks=12, max_model_len=12, max_num_batched_tokens=64)
    for rid, max_tokens in zip("abcd", (1, 2, 1, 2)):
        add(sched, rid, 2 if max_tokens == 1 else 1, max_tokens)   # 3 slots each
    add(sched, "e", 2, 3)                                  # 5 slots
    fake_step(sched)                                       # a-d fill the cache; a and c finish
    assert [r.request_id for r in sched.running] == ["b", "d"]
    assert sched.kv.pool.holes == [[0, 3], [6, 3]]
    assert sched.kv.memory_usage([], waiting_max_len=5).external_fragmentation == 6
    out = fake_step(sched)                                 # 6 slots free, no hole of 5: e waits
    assert [s.request.request_id for s in out.scheduled] == ["b", "d"]
    out = fake_step(sched)
    assert [s.request.request_id for s in out.scheduled] == ["e"]
    assert sched.kv.block_ids(out.scheduled[0].seq.seq_id) == [0, 1, 2, 3, 4]
    run_all(sched)


@pytest.mark.fuzz
@settings(max_examples=examples(40))
@given(reqs=st.lists(st.tuples(st.integers(1, 20), st.integers(1, 12)), min_size=1, max_size=8),
       policy=st.sampled_from(["max", "pow2", "oracle"]), num_blocks=st.integers(8, 40),
       block_size=st.sampled_from([1, 2, 4]), budget=st.integers(4, 40))
def test_every_request_finishes_without_leaks(reqs, policy, num_blocks, block_size, budget):
    sched = make_scheduler(policy, num_blocks, block_size, max_model_len=32, max_num_batched_tokens=budget,
                           max_num_seqs=budget)
    added = []
    for i, (p, m) in enumerate(reqs):
        try:
            added.append(add(sched, str(i), p, m))
        except ValueError:
            continue   # can never fit: refused up front
    run_all(sched)    # checks the invariants every step, and that every block is free at the end
    assert sched.stats.num_preemptions == 0
    assert all(r.seqs[0].num_output_tokens == r.max_tokens for r in added)


# ---- the engine end to end -------------------------------------------------------------------

def run_engine(llm, prompts, max_tokens):
    """Greedy tokens per prompt, and the most requests that ran at once."""
    engine, params = llm.engine, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    tokens, most = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[int(out.request_id)] = out.outputs[0].token_ids
        most = max(most, len(engine.scheduler.running))
        usage = engine.memory_usage()
        assert usage.total == engine.scheduler.kv.pool.num_blocks * engine.config.block_size
    stats = llm.kv_cache_stats()
    assert stats["num_used_blocks"] == 0 and stats["num_free_blocks"] == stats["num_blocks"]
    engine.check_paging_invariants()
    return [tokens[i] for i in range(len(prompts))], most


@pytest.fixture(scope="module")
def prompts(tiny_llama):
    return [tiny_llama.tokenizer.encode(p) for p in PROMPTS]


def test_every_allocator_gives_the_same_greedy_tokens(tiny_llama, prompts):
    results = {}
    for policy in ("paged", "max", "pow2", "oracle"):
        # 8 blocks of 16 = 128 slots; max_model_len 64: `max` holds two requests at a time.
        llm = LLM(tiny_llama.path, dtype="float32", kv_allocator=policy, num_gpu_blocks_override=8,
                  max_model_len=64, block_size=16, enable_prefix_caching=False)
        results[policy] = run_engine(llm, prompts, max_tokens=12)
    assert results["max"][0] == results["pow2"][0] == results["oracle"][0] == results["paged"][0]
    most = {policy: r[1] for policy, r in results.items()}
    assert most["max"] == 2 and most["paged"] >= most["oracle"] >= most["pow2"] > most["max"], most


def test_baselines_refuse_sharing_with_a_clear_error_and_serve_the_rest(tiny_llama, prompts):
    llm = LLM(tiny_llama.path, dtype="float32", kv_allocator="oracle", num_gpu_blocks_override=16,
              max_model_len=64)
    with pytest.raises(ValueError, match="cannot share blocks.*kv_allocator='paged'"):
        llm.generate({"prompt_token_ids": prompts[0]}, SamplingParams(n=2, max_tokens=4), use_tqdm=False)
    with pytest.raises(ValueError, match="cannot share blocks"):
        llm.beam_search([{"prompt_token_ids": prompts[0]}], BeamSearchParams(beam_width=2, max_tokens=4))
    out = llm.generate({"prompt_token_ids": prompts[1]}, SamplingParams(temperature=0, max_tokens=4),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    assert llm.kv_cache_stats()["num_used_blocks"] == 0
    with pytest.raises(ValueError, match="kv_allocator must be one of paged, max, pow2, oracle"):
        LLM(tiny_llama.path, kv_allocator="buddy")
