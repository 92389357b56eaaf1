"""The prefix cache's disk tier (kv/tier.py, worker/kv_tier.py): evicted blocks saved once and
read back with the same tokens as without it (float32, bf16, int8 KV), after a restart, across
two stores sharing a directory (no torn block, the size bound), and past damaged files."""
import asyncio
import logging
import os
import random
import threading
import time
from pathlib import Path

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.config import EngineConfig
from pagedserve.kv.block_pool import BlockPool, block_key
from pagedserve.kv.kv_cache_manager import KVCacheManager
from pagedserve.kv.tier import TierIndex, TierLink, pool_key, tier_key
from pagedserve.server.metrics import PrometheusStatLogger
from pagedserve.worker.kv_tier import KVTierStore, TierFileError
from tests.conftest import PROMPTS, hf_greedy
from tests.test_engine import assert_no_blocks_held
from tests.test_hybrid_models import BLOCK, hybrid, make  # noqa: F401 - the hybrid fixture

SP = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models("llama_gqa_untied")


@pytest.fixture(scope="module")
def prompts(model):
    rng = random.Random(53)
    V = len(model.tokenizer)
    return [[rng.randrange(3, V) for _ in range(90)] for _ in range(5)]   # 5 full blocks each, and a tail


def one_by_one(llm, prompts) -> list[list[int]]:
    return [llm.generate({"prompt_token_ids": p}, SP, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]


def tier_llm(model, path, **kw):
    kw.setdefault("dtype", "float32")
    return LLM(model.path, num_gpu_blocks_override=kw.pop("blocks", 14), kv_offload_path=str(path), **kw)


# ---- end to end ----------------------------------------------------------------------------
@pytest.mark.parametrize("kw", [dict(dtype="float32"), dict(dtype="bfloat16"), dict(dtype="float32",
                                                                                      kv_cache_dtype="int8")],
                         ids=["float32", "bf16", "int8-kv"])
def test_evicted_prefixes_come_back_from_the_tier_with_the_same_tokens(model, prompts, tmp_path, kw):
    """A pool of 14 blocks holds two prompts: running five twice evicts each before its second
    turn, which reads it back. The reference holds everything in its pool (the same KV reused)."""
    ref = one_by_one(LLM(model.path, num_gpu_blocks_override=256, **kw), prompts * 2)
    llm = tier_llm(model, tmp_path, **kw)
    assert one_by_one(llm, prompts * 2) == ref
    stats = llm.kv_cache_stats()
    assert stats["kv_offload_blocks_loaded"] >= 3 * 5 and stats["kv_offload_load_failures"] == 0
    assert stats["kv_offload_hits"] >= 3 * 5 * 16 and stats["kv_offload_bytes_read"] > 0
    # Written once: the second turn's evictions are of blocks the tier already holds.
    llm.engine.runner.tier.flush()
    assert stats["kv_offload_blocks_saved"] == len(list(tmp_path.glob("*.kvb"))) <= 5 * 5
    llm.shutdown()


def test_a_restarted_engine_reads_its_first_prefix_from_the_tier(model, prompts, tmp_path):
    first = tier_llm(model, tmp_path, blocks=64)
    ref = one_by_one(first, prompts[:1])
    assert first.kv_cache_stats()["kv_offload_blocks_saved"] == 0   # nothing evicted yet
    first.shutdown()                                                 # the pool's cached blocks saved
    again = tier_llm(model, tmp_path, blocks=64)
    assert again.kv_cache_stats()["kv_offload_blocks"] == 5
    out = again.generate({"prompt_token_ids": prompts[0]}, SP, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == ref[0] and out.num_cached_tokens == 5 * 16
    assert again.kv_cache_stats()["kv_offload_blocks_loaded"] == 5
    metrics = PrometheusStatLogger("m", prefix="vllm:")
    metrics.record(again.engine.scheduler_stats(), None)
    text = metrics.render().decode()
    assert "vllm:external_prefix_cache_hits_total{model_name=\"m\"} 80.0" in text
    assert "vllm:kv_offload_blocks{model_name=\"m\"} 5.0" in text and "vllm:kv_offload_bytes_read_total" in text
    # Another dtype is another fingerprint: it sees none of these files.
    assert tier_llm(model, tmp_path, dtype="bfloat16").kv_cache_stats()["kv_offload_blocks"] == 0


def run_to_end(engine) -> dict:
    """Step the engine until every request finished: each request's last output by id."""
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
    return outputs


def restarted_behind_a_running_request(model, prompts, tmp_path, blocks=64, running=24, queued=None, **kw):
    """A restarted engine (max_num_seqs 1, `blocks` blocks) running prompts[1] (`running` tokens),
    with prompts[0]'s blocks in its tier; `queued` (ids and prompts; by default prompts[0] as
    "queued") then queue behind it. Returns the engine and prompts[0]'s reference tokens."""
    first = tier_llm(model, tmp_path, blocks=64)
    ref = one_by_one(first, prompts[:1])[0]
    first.shutdown()
    again = tier_llm(model, tmp_path, blocks=blocks, max_num_seqs=1, **kw)
    engine = again.engine
    engine.add_request("running", {"prompt_token_ids": prompts[1]}, SamplingParams(temperature=0, max_tokens=running,
                                                                                  ignore_eos=True))
    engine.step()
    for rid, prompt in (queued or {"queued": prompts[0]}).items():
        engine.add_request(rid, {"prompt_token_ids": prompt}, SP)
    return again, ref


def test_a_request_queued_behind_a_running_one_reads_its_prefix_ahead(model, prompts, tmp_path):
    """After a restart, a request that max_num_seqs keeps waiting behind a running one starts its
    tier reads at once (read ahead while the other computes), not when a seat frees; its tokens
    are the tier-less engine's."""
    llm, ref = restarted_behind_a_running_request(model, prompts, tmp_path)
    engine, tier = llm.engine, llm.engine.scheduler.tier
    engine.step()
    queued = engine.requests["queued"]
    assert engine.requests["running"].status.name == "RUNNING" and queued.status.name == "WAITING"
    stats = llm.kv_cache_stats()
    assert stats["kv_offload_hits"] == 5 * 16                       # looked up while the other runs
    assert tier.waiting("queued") or stats["kv_offload_blocks_loaded"] == 5
    outputs = run_to_end(engine)
    assert outputs["queued"].outputs[0].token_ids == ref and outputs["queued"].num_cached_tokens == 5 * 16
    assert llm.kv_cache_stats()["kv_offload_blocks_loaded"] == 5
    assert_no_blocks_held(llm)


def test_read_ahead_off_reads_a_queued_prefix_only_when_admission_reaches_it(model, prompts, tmp_path):
    """kv_offload_read_ahead=False (the benchmark's A/B): the queued request is not looked up
    while the other runs; once a seat frees its prefix still comes from the tier, same tokens."""
    llm, ref = restarted_behind_a_running_request(model, prompts, tmp_path, kv_offload_read_ahead=False)
    engine = llm.engine
    engine.step()
    assert engine.requests["queued"].status.name == "WAITING"
    assert llm.kv_cache_stats()["kv_offload_hits"] == 0 and not engine.scheduler.tier.loading
    outputs = run_to_end(engine)
    assert outputs["queued"].outputs[0].token_ids == ref and outputs["queued"].num_cached_tokens == 5 * 16
    assert llm.kv_cache_stats()["kv_offload_blocks_loaded"] == 5
    assert_no_blocks_held(llm)


def test_read_ahead_never_evicts_the_landed_blocks_of_a_request_ahead(model, prompts, tmp_path):
    """Four requests queued behind a running one after a restart, in a pool that holds about two
    of their prefixes beside it: each prefix is read from the tier once (reads started behind a
    request whose reads landed would evict its blocks, and it would read them again); every
    request's tokens are the tier-less engine's."""
    first = tier_llm(model, tmp_path, blocks=64)
    refs = one_by_one(first, prompts)
    first.shutdown()
    llm = tier_llm(model, tmp_path, blocks=24, max_num_seqs=1, check_invariants=True)
    engine = llm.engine
    engine.add_request("running", {"prompt_token_ids": prompts[4]}, SamplingParams(temperature=0, max_tokens=24,
                                                                                  ignore_eos=True))
    engine.step()
    for i in range(4):
        engine.add_request(f"q{i}", {"prompt_token_ids": prompts[i]}, SP)
    outputs = run_to_end(engine)
    assert [outputs[f"q{i}"].outputs[0].token_ids for i in range(4)] == refs[:4]
    assert llm.kv_cache_stats()["kv_offload_blocks_loaded"] == 5 * 5          # each prefix read once
    assert_no_blocks_held(llm)


def test_landed_reads_are_held_until_admission(model, prompts, tmp_path):
    """A restarted engine (max_num_seqs 1, 16 blocks) runs one request; queued behind it, one
    request whose prompt no tier holds and one whose prefix the tier holds (read ahead: its reads
    land long before a seat frees). When the running one finishes its blocks are freed after the
    landed ones, so the first queued request's prefill evicted the landed blocks (the least
    recently used cached ones) and the request behind read them again (7 blocks; 5 held, the
    running request's cached blocks evicted instead). Same tokens; nothing leaks."""
    cold_ref = one_by_one(LLM(model.path, dtype="float32", num_gpu_blocks_override=64), prompts[2:3])[0]
    llm, ref = restarted_behind_a_running_request(model, prompts, tmp_path, blocks=16, check_invariants=True,
                                                  queued={"cold": prompts[2], "read": prompts[0]})
    outputs = run_to_end(llm.engine)
    assert outputs["cold"].outputs[0].token_ids == cold_ref and outputs["read"].outputs[0].token_ids == ref
    assert outputs["read"].num_cached_tokens == 5 * 16
    assert llm.kv_cache_stats()["kv_offload_blocks_loaded"] == 5                 # read once
    assert_no_blocks_held(llm)


def test_a_running_requests_growth_takes_held_blocks_before_it_preempts(model, prompts, tmp_path):
    """A restarted engine (max_num_seqs 1, 14 blocks) runs a request that grows to 10 blocks while
    one queued behind it holds the 5 blocks its read-ahead read: the running request wins (the
    hold is dropped, nobody is preempted: a hold that outranked it would preempt it forever), and
    both requests' tokens are the tier-less engine's; the invariant checker runs every step."""
    long = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    ample = LLM(model.path, dtype="float32", num_gpu_blocks_override=64)
    long_ref = ample.generate({"prompt_token_ids": prompts[1]}, long, use_tqdm=False)[0].outputs[0].token_ids
    llm, ref = restarted_behind_a_running_request(model, prompts, tmp_path, blocks=14, running=60,
                                                  check_invariants=True)
    engine, tier = llm.engine, llm.engine.scheduler.tier
    outputs, held = {}, False
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
        held = held or (tier.holds("queued") and not tier.waiting("queued"))
    assert held and engine.scheduler.stats.num_preemptions == 0
    assert outputs["running"].outputs[0].token_ids == long_ref and outputs["queued"].outputs[0].token_ids == ref
    assert_no_blocks_held(llm)


def test_a_request_ahead_is_admitted_past_the_holds_behind_it(model, prompts, tmp_path):
    """A restarted engine (max_num_seqs 1, 16 blocks): behind a running request wait a cold
    180-token prompt (12 blocks) and one whose 5 blocks the tier holds (read ahead, held). Once the
    first finishes, the cold one needs the held blocks: the holds behind it give way (first come,
    first served; kept, nothing would ever run again). Tokens are the tier-less engine's."""
    long_prompt = prompts[2] + prompts[3]
    cold_ref = one_by_one(LLM(model.path, dtype="float32", num_gpu_blocks_override=64), [long_prompt])[0]
    llm, ref = restarted_behind_a_running_request(model, prompts, tmp_path, blocks=16, running=6, check_invariants=True,
                                                  queued={"cold": long_prompt, "read": prompts[0]})
    engine, tier = llm.engine, llm.engine.scheduler.tier
    while "running" in engine.requests:
        engine.step()
    assert tier.holds("read") and not tier.waiting("read")
    outputs = run_to_end(engine)
    assert outputs["cold"].outputs[0].token_ids == cold_ref and outputs["read"].outputs[0].token_ids == ref
    assert_no_blocks_held(llm)


def test_an_abort_releases_held_reads(model, prompts, tmp_path):
    """A queued request whose reads landed holds their blocks; aborted, it lets them go at once."""
    llm, _ = restarted_behind_a_running_request(model, prompts, tmp_path, check_invariants=True)
    engine, tier = llm.engine, llm.engine.scheduler.tier
    while not tier.holds("queued") or tier.waiting("queued"):
        engine.step()
    free = llm.kv_cache_stats()["num_free_blocks"]
    engine.abort_request("queued")
    assert not tier.fetches and llm.kv_cache_stats()["num_free_blocks"] == free + 5
    run_to_end(engine)
    assert_no_blocks_held(llm)


def test_an_abort_while_reads_are_in_flight_leaks_nothing(model, prompts, tmp_path):
    """A queued request aborted while its read-ahead is in flight: its pins go at once, the reads'
    blocks when they land (cached then, free); the invariant checker runs every step."""
    llm, _ = restarted_behind_a_running_request(model, prompts, tmp_path)
    engine, tier, store = llm.engine, llm.engine.scheduler.tier, llm.engine.runner.tier
    gate = threading.Event()
    read = store._read
    store._read = lambda key, block_id: gate.wait(60) and read(key, block_id)
    engine.step()                                    # the queued request's reads start, and stall
    assert tier.waiting("queued") and len(tier.loading) == 5
    engine.abort_request("queued")
    assert not tier.fetches and len(tier.loading) == 5
    engine.check_paging_invariants()
    gate.set()
    while engine.has_unfinished_requests():
        engine.step()
    engine.step()                                    # nothing runs: waits for every read in flight
    assert not tier.loading and llm.kv_cache_stats()["kv_offload_blocks_loaded"] == 5
    assert_no_blocks_held(llm)
    out = llm.generate({"prompt_token_ids": prompts[0]}, SP, use_tqdm=False)[0]
    assert out.num_cached_tokens == 5 * 16                           # the landed blocks are cached


def test_the_server_waits_at_shutdown_for_the_pools_blocks_to_reach_the_tier(model, prompts, tmp_path, monkeypatch):
    """The server's exit (lifespan end, as on SIGTERM): the engine thread saves the pool's cached
    blocks to the disk tier on its way out, slowed here past the 5 s an exit otherwise waits; the
    server waits for it, so a restart finds every prompt's blocks (found: only those written in 5 s)."""
    from pagedserve.engine.async_llm import AsyncLLM
    from pagedserve.server.app import build_app
    from pagedserve.server.state import ServerState
    write = KVTierStore._write_file
    monkeypatch.setattr(KVTierStore, "_write_file", staticmethod(lambda *a: time.sleep(0.25) or write(*a)))
    llm = AsyncLLM(EngineConfig(model=model.path, dtype="float32", num_gpu_blocks_override=64,
                                kv_offload_path=str(tmp_path)))
    app = build_app(ServerState(llm, ["m"], PrometheusStatLogger("m")))

    async def serve():
        async with app.router.lifespan_context(app):
            await llm.wait_started()
            for i, p in enumerate(prompts):
                async for _ in llm.generate({"prompt_token_ids": p}, SP, f"r{i}"):
                    pass
    asyncio.run(serve())
    assert len(list(tmp_path.glob("*.kvb"))) >= 5 * 5                  # 5 full prompt blocks each


def test_a_flipped_byte_is_detected_and_the_block_recomputed(model, prompts, tmp_path, caplog):
    first = tier_llm(model, tmp_path, blocks=64)
    ref = one_by_one(first, prompts[:1])
    first.shutdown()
    files = sorted(tmp_path.glob("*.kvb"), key=lambda f: f.stat().st_mtime_ns)
    data = bytearray(files[2].read_bytes())
    data[-100] ^= 0x10                       # one bit of one value of the third block
    files[2].write_bytes(bytes(data))
    again = tier_llm(model, tmp_path, blocks=64)
    with caplog.at_level(logging.WARNING, logger="pagedserve.worker.kv_tier"):
        out = again.generate({"prompt_token_ids": prompts[0]}, SP, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == ref[0]
    stats = again.kv_cache_stats()
    assert stats["kv_offload_load_failures"] >= 1 and "checksum" in caplog.text
    assert again.engine.runner.tier.rejected >= 1


def test_two_engines_share_a_directory_at_once(model, prompts, tmp_path):
    """Two engines run the same prompts at the same time on one directory (both write the same
    keys, each reads what either wrote): no refused file, the reference's tokens."""
    ref = one_by_one(LLM(model.path, dtype="float32", num_gpu_blocks_override=256), prompts * 2)
    engines = [tier_llm(model, tmp_path) for _ in range(2)]
    outs: dict[int, list] = {}

    def run(i):
        outs[i] = one_by_one(engines[i], prompts * 2 if i == 0 else prompts[::-1] * 2)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert outs[0] == ref and outs[1] == one_by_one_ref(ref, prompts)
    for llm in engines:
        assert llm.engine.runner.tier.rejected == 0 and llm.kv_cache_stats()["kv_offload_blocks_loaded"] > 0


def one_by_one_ref(ref, prompts):
    """The reference's tokens for the reversed order (each prompt's tokens do not depend on order)."""
    by_prompt = {tuple(p): r for p, r in zip(prompts, ref)}
    return [by_prompt[tuple(p)] for p in prompts[::-1] * 2]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_parallel_sampling_and_beams_over_the_tier(tiny_llama, tmp_path, mode):
    """test_preemption's mix (greedy, n=2, beam search; hundreds of preemptions in a pool of 40
    blocks of 2 tokens) with the tier below the pool, under the invariant checker: the same outputs
    as with an ample pool."""
    from tests.test_preemption import BLOCK_SIZE, TIGHT_BLOCKS, host_bytes, run_mix
    prompts = [tiny_llama.tokenizer.encode(p) for p in PROMPTS]
    ample, _ = run_mix(LLM(tiny_llama.path, dtype="float32", block_size=BLOCK_SIZE, num_gpu_blocks_override=2048),
                       prompts)
    kw = dict(preemption_mode=mode, swap_space=host_bytes(tiny_llama, 64) / 1024**3) if mode == "swap" else {}
    llm = LLM(tiny_llama.path, dtype="float32", block_size=BLOCK_SIZE, num_gpu_blocks_override=TIGHT_BLOCKS,
              kv_offload_path=str(tmp_path), **kw)
    outs, preempted = run_mix(llm, prompts)
    assert outs == ample and preempted
    stats = llm.kv_cache_stats()
    assert stats["kv_offload_blocks_loaded"] > 0 and stats["kv_offload_load_failures"] == 0
    assert_no_blocks_held(llm)


def test_salted_blocks_are_found_only_under_their_salt(model, prompts, tmp_path):
    first = tier_llm(model, tmp_path, blocks=64)
    first.generate({"prompt_token_ids": prompts[0], "cache_salt": "tenant-a"}, SP, use_tqdm=False)
    first.shutdown()
    again = tier_llm(model, tmp_path, blocks=64)
    plain = again.generate({"prompt_token_ids": prompts[0]}, SP, use_tqdm=False)[0]
    assert plain.num_cached_tokens == 0
    salted = again.generate({"prompt_token_ids": prompts[0], "cache_salt": "tenant-a"}, SP, use_tqdm=False)[0]
    assert salted.num_cached_tokens == 5 * 16


def test_settings(tmp_path):
    assert EngineConfig(kv_offload_path=str(tmp_path)).kv_offload_bytes == 8 * 1024**3
    with pytest.raises(ValueError, match="kv_offload_gb needs kv_offload_path"):
        EngineConfig(kv_offload_gb=2)
    for kw, field in [(dict(kv_offload_gb=0), "kv_offload_gb"), (dict(enable_prefix_caching=False), "prefix"),
                      (dict(kv_allocator="max"), "paged"), (dict(tensor_parallel_size=2), "tensor_parallel")]:
        with pytest.raises(ValueError, match=field):
            EngineConfig(kv_offload_path=str(tmp_path), **kw)


# ---- the engine side alone -----------------------------------------------------------------
def cached_pool(n: int, index: TierIndex) -> tuple[BlockPool, TierLink, list[bytes]]:
    pool = BlockPool(n)
    link = TierLink(pool, index)
    keys = [block_key(None, [i]) for i in range(n)]
    blocks = pool.allocate(n)
    for b, k in zip(blocks, keys):
        pool.cache(b, k)
    pool.release(blocks)
    return pool, link, keys


def test_an_evicted_block_is_saved_once_and_fetched_into_pinned_blocks():
    index = TierIndex(capacity=3)
    pool, link, keys = cached_pool(4, index)
    pool.release(pool.allocate(4))               # evicts all four: saved, the oldest past capacity dropped
    saves, loads, deletes = link.take()
    assert [k for _, k in saves] == keys and deletes == [keys[0]] and list(index.keys) == keys[1:]
    assert not link.fetch("r", keys[1:3], blocks_needed=5, reserve=0, block_size=16)   # would not fit
    assert link.fetch("r", keys[1:3], blocks_needed=3, reserve=0, block_size=16)
    assert [k for k, _ in link.take()[1]] == keys[1:3] and link.waiting("r")
    assert all(b.ref_cnt == 2 for b in link.loading.values())    # the load's and the request's
    link.finished([keys[1]], [])
    assert link.waiting("r") and pool.num_free_blocks == 2        # pinned while a read is in flight
    link.finished([], [keys[2]])
    assert not link.waiting("r") and pool.lookup(keys[1]) is not None and keys[2] not in index
    assert link.holds("r") and pool.num_free_blocks == 3          # landed: held for admission (not the failed one)
    assert not link.drop_landed(keep="r") and link.drop_landed()  # an allocation short of blocks drops it
    assert not link.holds("r") and pool.num_free_blocks == 4      # cached, free, nothing pinned
    pool.release(pool.allocate(4))               # keys[1] evicted again: the tier has it, no save
    assert link.take()[0] == []
    assert index.stats.blocks_saved == 4 and index.stats.blocks_loaded == 1 and index.stats.load_failures == 1


def test_a_batch_dependent_block_is_filed_under_its_own_key_and_never_read_back_for_a_greedy_request():
    """A block a step of sampled requests only computed (batch_invariant auto) goes to the tier
    under tier_key(key, False): a greedy request's fetch (invariant_only) skips it, a sampled
    request's reads it back, flagged so; a restarted engine's index (the files' keys) tells the
    copies apart, and a batch-invariant copy is preferred."""
    pool, link, keys = cached_pool(2, TierIndex(capacity=8))
    pool.cached[keys[1]].batch_invariant = False
    pool.release(pool.allocate(2))                    # both evicted: saved
    assert [k for _, k in link.take()[0]] == [keys[0], tier_key(keys[1], False)]
    assert pool_key(tier_key(keys[1], False)) == (keys[1], False) and pool_key(keys[1]) == (keys[1], True)
    index = TierIndex(capacity=8, keys=list(link.index.keys))     # a restart: the files' keys
    pool = BlockPool(4)
    link = TierLink(pool, index)
    assert link.fetch("greedy", keys, blocks_needed=2, reserve=0, block_size=16, invariant_only=True)
    assert [k for k, _ in link.take()[1]] == [keys[0]]             # stops at the batch-dependent block
    link.finished([keys[0]], [])
    assert link.fetch("sampled", keys, blocks_needed=2, reserve=0, block_size=16)
    assert [k for k, _ in link.take()[1]] == [tier_key(keys[1], False)]
    link.finished([tier_key(keys[1], False)], [])
    assert pool.lookup(keys[1]) is not None and pool.lookup(keys[1], invariant_only=True) is None
    assert pool.lookup(keys[0], invariant_only=True) is not None
    index.add(keys[1])                                # a batch-invariant copy saved meanwhile: preferred
    assert link.tier_source(keys[1]) == keys[1] and link.tier_source(keys[1], invariant_only=True) == keys[1]


@pytest.mark.parametrize("hybrid", ["gemma3"], indirect=True)
def test_sliding_window_models_read_every_groups_blocks_back(hybrid, tmp_path):
    """KV groups (Gemma 3's pattern: window layers and a full one): each group's evicted blocks
    go to the tier under their own keys and a prompt's prefix comes back for every group (the
    full group's blocks, the window groups' last blocks), with transformers' greedy tokens."""
    tm = hybrid
    rng = random.Random(7)
    prompts = [[rng.randrange(3, len(tm.tokenizer)) for _ in range(66)] for _ in range(3)]
    llm = make(tm, num_gpu_blocks_override=64, kv_offload_path=str(tmp_path))
    assert llm.engine.scheduler.tier is not None and len(llm.engine.kv_windows) > 1
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for p in prompts + prompts:       # each prompt's blocks evicted by the next two
        out = llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == hf_greedy(tm.hf, p, 6)
    stats = llm.kv_cache_stats()
    assert stats["kv_offload_blocks_loaded"] >= 3 * (64 // BLOCK) and stats["kv_offload_load_failures"] == 0
    assert stats["prefix_cache_hits"] >= 3 * 64 and stats["num_used_blocks"] == 0


# ---- the worker's store --------------------------------------------------------------------
def make_store(root, max_bytes=1 << 30, fingerprint="ab" * 32, blocks=4, dtype=torch.float32, **meta) -> KVTierStore:
    cache = torch.zeros(2, 2, blocks, 16, 2, 256, dtype=dtype)          # 64 KiB a block (float32)
    return KVTierStore(str(root), max_bytes, fingerprint, cache, dict(dict(kv_format="auto", block_size=16), **meta))


def test_damaged_and_foreign_files_are_refused(tmp_path):
    store = make_store(tmp_path)
    key = bytes(range(32))
    store.blocks[:, :, 1] = 7.0
    store.save([(1, key)])
    store.flush()
    good = bytearray(Path(store.path(key)).read_bytes())
    assert torch.equal(store.parse(key, memoryview(good)), store.blocks[:, :, 1])
    for bad, why in [(good[:-1], "payload of"), (good + b"x", "payload of"), (good[:20], "truncated"),
                     (b"XXXXXXXX" + good[8:], "not a version"), (good, "header key")]:
        bad = bytearray(bad)
        with pytest.raises(TierFileError, match=why):
            store.parse(bytes(32) if why == "header key" else key, memoryview(bad))
    other = make_store(tmp_path / "o", fingerprint="cd" * 32)
    with pytest.raises(TierFileError, match="fingerprint"):
        other.parse(key, memoryview(good))
    with pytest.raises(TierFileError, match="block_size"):
        make_store(tmp_path / "b", block_size=32).parse(key, memoryview(good))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_the_read_path_lands_whole_blocks_and_refuses_damaged_files(tmp_path, dtype):
    """Files on disk through start_loads / collect (a CPU cache reads them straight into the
    block): an intact one lands with the saved bytes in every layer's K and V; a truncated,
    longer, flipped or foreign one is refused (failed, counted), whatever bytes it left."""
    store = make_store(tmp_path, dtype=dtype)
    key = bytes(range(32))
    store.blocks[:, :, 1] = torch.arange(store.blocks[:, :, 1].numel()).view(store.block_shape).to(dtype)
    store.save([(1, key)])
    store.flush()
    good = Path(store.path(key)).read_bytes()

    def load(data: bytes) -> list:
        Path(store.path(key)).write_bytes(data)
        store.blocks[:, :, 2] = 0
        store.start_loads([(key, 2)])
        report = store.collect(wait=[key])
        assert report.loaded + report.failed == [key]
        return report.loaded

    assert load(good) == [key] and torch.equal(store.blocks[:, :, 2], store.blocks[:, :, 1])
    assert store.bytes_read == len(good)
    flipped = bytearray(good)
    flipped[-3] ^= 0x01
    foreign = make_store(tmp_path / "f", fingerprint="cd" * 32, dtype=dtype)
    foreign.blocks[:, :, 0] = store.blocks[:, :, 1]
    foreign.save([(0, key)])
    foreign.flush()
    for bad in (good[:-1], good + b"x", good[:20], b"XXXXXXXX" + good[8:], bytes(flipped),
                Path(foreign.path(key)).read_bytes()):
        assert load(bad) == []
    assert store.rejected == 6


def test_reads_start_no_openmp_workers(tmp_path):
    """A reader thread copies a block into the pool with one OpenMP thread: a team of its own
    would put more OpenMP threads than CPUs, and libgomp then stops spinning at barriers, which
    slowed every later step of the engine (a tier hit's 33-token forward 449 ms against 344 ms
    for 32 tokens before any read, 1.7B shape on 2 vCPUs). The load adds its reader thread alone."""
    from tests.test_async_llm import _os_thread_ids
    cache = torch.zeros(4, 2, 3, 16, 8, 256)               # 256 Ki values a block: a parallel copy
    store = KVTierStore(str(tmp_path), 1 << 30, "ab" * 32, cache, dict(kv_format="auto", block_size=16))
    key = bytes(range(32))
    store.blocks[:, :, 0] = 3.0
    store.save([(0, key)])
    store.flush()
    store._pending.clear()                                 # read from the file
    before = _os_thread_ids()
    store.start_loads([(key, 1)])
    assert store.collect(wait=[key]).loaded == [key] and torch.equal(store.blocks[:, :, 1], store.blocks[:, :, 0])
    assert len(_os_thread_ids() - before) == 1, "a reader thread started OpenMP workers"
    store.close()


def test_two_stores_sharing_a_directory_never_read_a_torn_block(tmp_path):
    """One store rewrites a key again and again with new contents while another reads it: each
    read is one whole version (atomic renames), never a mix or a refusal."""
    writer, reader = make_store(tmp_path), make_store(tmp_path)
    key = bytes(32)
    writer.save([(0, key)])
    writer.flush()
    stop = threading.Event()

    def rewrite():
        i = 0
        while not stop.is_set():
            i += 1
            writer.blocks[:, :, 0] = float(i)
            writer.save([(0, key)])
            writer._pending.clear()              # make the reader go to the file every time
            writer.flush()

    t = threading.Thread(target=rewrite)
    t.start()
    try:
        for _ in range(150):
            reader.start_loads([(key, 1)])
            report = reader.collect(wait=[key])
            assert report.loaded == [key], report
            block = reader.blocks[:, :, 1]
            assert torch.all(block == block.flatten()[0]), "a torn block"
    finally:
        stop.set()
        t.join()
    assert reader.rejected == 0


def test_the_size_bound_holds_with_two_writers(tmp_path):
    bound = 12
    a, b = make_store(tmp_path, blocks=1), make_store(tmp_path, blocks=1)
    a.max_bytes = b.max_bytes = bound * a.file_bytes

    def write(store, tag):
        for i in range(40):
            store.save([(0, bytes([tag, i]) + bytes(30))])
            store.flush()

    threads = [threading.Thread(target=write, args=(s, n)) for n, s in enumerate((a, b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    total = sum(f.stat().st_size for f in tmp_path.glob("*.kvb"))
    assert total <= (bound + 1) * a.file_bytes        # one write of the other store may race a scan
    lost = a.collect().lost + b.collect().lost
    assert len(lost) >= 80 - bound - 1 and len(set(lost)) == len(lost)


def test_a_full_disk_turns_saving_off_with_one_log_line(tmp_path, monkeypatch, caplog):
    store = make_store(tmp_path)

    def full(path, header, payload):          # a write fails half way, as on a full disk
        Path(path).write_bytes(header)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store, "_write_file", full)
    with caplog.at_level(logging.ERROR, logger="pagedserve.worker.kv_tier"):
        for i in range(3):
            store.save([(0, bytes([i]) * 32)])
        store.flush()
    report = store.collect()
    assert not report.writable and len(report.lost) == 3 and report.bytes_written == 0
    assert len([r for r in caplog.records if "saves nothing more" in r.message]) == 1
    assert not list(tmp_path.iterdir())                   # no temporary file left behind
