"""The KV snapshot (kv/snapshot.py, engine/kv_view.py) against the KV manager's real state.

Each check compares the JSON with the block pool, the block tables and swap space read
directly, on real engines running the tiny model (paging invariants checked every step).
"""
import pytest

from pagedserve import BeamSearchParams, SamplingParams
from pagedserve.engine.kv_view import KVView, apply_update, capture
from pagedserve.kv.block_pool import prefix_block_keys
from pagedserve.kv.kv_cache_manager import KVCacheManager
from tests.test_engine import assert_no_blocks_held, make_llm
from tests.test_preemption import host_bytes


def expected_state(block, holders: int) -> str:
    if holders == 0:
        return "free" if block.key is None else "cached"
    return "shared" if holders > 1 else "owned"


def check_against_kv(snap: dict, engine) -> None:
    """Every block's state, ref count, owners and hash, and every table, as the KV manager has them."""
    sched, kv = engine.scheduler, engine.scheduler.kv
    owner_of = {s.seq_id: r.request_id for q in (sched.running, sched.waiting, sched.swapped) for r in q
                for s in r.seqs}
    assert snap["num_blocks"] == kv.num_blocks == len(snap["blocks"])
    for pool, tables, blocks in ((kv.pool, kv.tables, snap["blocks"]), (kv.swap.pool, kv.swap.tables,
                                                                         snap["host_blocks"])):
        assert len(blocks) == pool.num_blocks
        for block, row in zip(pool.blocks, blocks):
            holders = sorted(sid for sid, t in tables.items() if block in t)
            assert row["id"] == block.block_id and row["ref_cnt"] == block.ref_cnt == len(holders)
            assert row["state"] == expected_state(block, len(holders))
            assert row["seqs"] == holders and row["owners"] == sorted({owner_of[s] for s in holders})
            assert row.get("hash") == (block.key.hex()[:16] if block.key else None)
    for r in snap["requests"]:
        for s in r["seqs"]:
            on_host = s["seq_id"] in kv.swap.tables
            assert s["pool"] == ("host" if on_host else "device")
            table = (kv.swap.tables if on_host else kv.tables).get(s["seq_id"], [])
            assert s["block_table"] == [b.block_id for b in table]
    stats = engine.kv_cache_stats()
    for name in ("num_used_blocks", "num_free_blocks", "num_cached_blocks", "prefix_cache_hits", "num_preemptions"):
        assert snap["counters"][name] == stats[name]
    assert snap["counters"]["num_running"] == len(sched.running)
    assert sum(b["state"] in ("owned", "shared") for b in snap["blocks"]) == stats["num_used_blocks"]


def test_parallel_sampling_shows_the_shared_prompt_blocks_then_cached_text(tiny_llama):
    llm = make_llm(tiny_llama, num_gpu_blocks_override=32)
    engine, kv = llm.engine, llm.engine.scheduler.kv
    prompt = tiny_llama.tokenizer.encode("Once upon a time there was a tiny language model that liked to count: "
                                         "one two three four five.")
    assert len(prompt) > 32
    req = engine.add_request("p", {"prompt_token_ids": prompt},
                             SamplingParams(n=4, temperature=1.0, seed=0, max_tokens=6, ignore_eos=True))
    snap = llm.kv_snapshot()
    assert [r["status"] for r in snap["requests"]] == ["waiting"]
    assert all(b["state"] == "free" for b in snap["blocks"])
    while len(req.seqs) < 4:
        engine.step()
    snap = llm.kv_snapshot()
    check_against_kv(snap, engine)
    full = len(prompt) // 16
    shared = [b for b in snap["blocks"] if b["state"] == "shared"]
    assert len(shared) >= full and all(b["ref_cnt"] == 4 and b["owners"] == ["p"] for b in shared)
    (r,) = snap["requests"]
    assert r["status"] == "running" and r["n"] == 4 and len(r["seqs"]) == 4
    tables = [s["block_table"] for s in r["seqs"]]
    assert all(t[:full] == tables[0][:full] for t in tables)     # the prompt's full blocks, shared
    while engine.has_unfinished_requests():
        engine.step()
    snap = llm.kv_snapshot()
    check_against_kv(snap, engine)
    assert snap["requests"] == [] and not any(b["state"] in ("owned", "shared") for b in snap["blocks"])
    for i, key in enumerate(prefix_block_keys(prompt, 16, full)):   # the prompt's blocks stay findable,
        row = snap["blocks"][kv.pool.lookup(key).block_id]                # with their tokens' text
        assert row["state"] == "cached" and row["hash"] == key.hex()[:16]
        assert row["text"] == tiny_llama.tokenizer.decode(prompt[16 * i:16 * i + 16])
    assert_no_blocks_held(llm)


def test_updates_applied_to_the_first_snapshot_give_every_later_one(tiny_llama):
    """Greedy, n=2 and beam requests with preemption to swap space: at every step the page's
    picture (first snapshot + updates) equals a fresh full snapshot, and both equal the KV state."""
    llm = make_llm(tiny_llama, block_size=2, num_gpu_blocks_override=40, preemption_mode="swap",
                   swap_space=host_bytes(tiny_llama, 24) / 1024**3)
    engine = llm.engine
    prompts = [tiny_llama.tokenizer.encode(p) for p in ("The quick brown fox", "Paged attention stores",
                                                         "Once upon a time there was", "Keys and values")]
    for i, p in enumerate(prompts):
        engine.add_request(f"g{i}", {"prompt_token_ids": p},
                           SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    engine.add_request("n", {"prompt_token_ids": prompts[0]}, SamplingParams(n=2, max_tokens=12, ignore_eos=True))
    engine.add_request("b", {"prompt_token_ids": prompts[2]}, BeamSearchParams(beam_width=2, max_tokens=8))
    view = KVView(engine.decode_tokens)
    page = view.full(capture(engine))
    seen = set()
    while engine.has_unfinished_requests():
        engine.step()
        update = view.update(capture(engine))
        fresh = KVView(engine.decode_tokens).full(capture(engine))
        if update is not None:
            page = apply_update(page, update)
        page["time"] = fresh["time"]
        assert page == fresh
        check_against_kv(fresh, engine)
        seen |= {b["state"] for b in fresh["blocks"]} | {"host:" + b["state"] for b in fresh["host_blocks"]}
        seen |= {r["status"] for r in fresh["requests"]}
    assert {"owned", "shared", "cached", "host:owned", "swapped"} <= seen
    assert view.update(capture(engine)) is None     # nothing changed since the last step
    assert_no_blocks_held(llm)


def test_contiguous_needs_beside_paging(tiny_llama):
    llm = make_llm(tiny_llama, num_gpu_blocks_override=64, max_model_len=256)
    engine = llm.engine
    engine.add_request("a", {"prompt_token_ids": list(range(3, 23))},
                       SamplingParams(n=2, max_tokens=30, ignore_eos=True))
    engine.add_request("w", {"prompt_token_ids": list(range(3, 10))}, SamplingParams(max_tokens=5))
    while len(engine.requests["a"].seqs) < 2:
        engine.step()
    snap = llm.kv_snapshot()
    running = [r for r in snap["requests"] if r["status"] == "running"]
    # Orca-Max: 256 slots = 16 blocks per live sequence; Orca-Oracle: prompt + max_tokens per sequence.
    assert snap["contiguous"]["orca_max_blocks"] == sum(16 * len(r["seqs"]) for r in running)
    assert snap["contiguous"]["orca_oracle_blocks"] == sum(
        -(-(r["num_prompt_tokens"] + r["max_tokens"]) // 16) * len(r["seqs"]) for r in running)
    assert snap["contiguous"]["paged_blocks"] == engine.kv_cache_stats()["num_used_blocks"]


def test_a_contiguous_allocator_shows_its_regions(tiny_llama):
    llm = make_llm(tiny_llama, num_gpu_blocks_override=64, max_model_len=128, kv_allocator="max")
    engine = llm.engine
    engine.add_request("a", {"prompt_token_ids": list(range(3, 23))}, SamplingParams(max_tokens=4))
    engine.step()
    snap = llm.kv_snapshot()
    assert snap["kv_allocator"] == "max" and snap["host_blocks"] == []
    owned = [b["id"] for b in snap["blocks"] if b["state"] == "owned"]
    assert owned == list(range(8)) == snap["requests"][0]["seqs"][0]["block_table"]   # 128 slots / 16
    assert all(b["owners"] == ["a"] for b in snap["blocks"][:8])


def test_cached_tokens_are_pruned_to_the_keys_in_use():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    for i in range(40):   # 40 different two-block prompts through a four-block cache
        tokens = [i, i + 100, i + 200, i + 300, 7]
        kv.allocate(i, tokens, 0, len(tokens))
        kv.free(i)
        assert len(kv.cached_tokens) <= 2 * 4 + 64
        snap = kv.snapshot()
        assert {k for k in snap.device.keys if k is not None} == set(kv.pool.cached)
        for key, tokens in zip(prefix_block_keys(tokens, 2, 2), ([i, i + 100], [i + 200, i + 300])):
            assert snap.cached_tokens[key] == tuple(tokens)


def test_the_kv_map_frames_replay_to_the_final_state(tiny_llama):
    from pagedserve.engine.kv_map import KVMapRecorder
    llm = make_llm(tiny_llama, num_gpu_blocks_override=48)
    recorder = KVMapRecorder(llm.engine)
    llm.generate([{"prompt_token_ids": list(range(3, 40))}], SamplingParams(n=3, max_tokens=10, ignore_eos=True),
                 use_tqdm=False)
    recorder.close()
    first, *updates = recorder.frames
    assert len(updates) >= 10 and all(b["state"] == "free" for b in first["blocks"])
    page, peak = first, 0
    for u in updates:
        page = apply_update(page, u)
        peak = max(peak, sum(b["state"] == "shared" for b in page["blocks"]))
    assert peak >= 2                                # the prompt's two full blocks, shared by the three
    final = llm.kv_snapshot()
    for name in ("time", "step"):
        final.pop(name), page.pop(name)
    assert page == final


def test_the_snapshot_benchmark_runs():
    """benchmarks/kv_snapshot.py, tiny: the filled cache is what it says and every figure is there."""
    from benchmarks.kv_snapshot import measure
    row = measure(400, reps=3, seed=0, decode=None)
    assert row["num_blocks"] == 400 and row["used_blocks"] > 0.5 * 400 and row["cached_blocks"] > 0
    assert row["requests"] > 0 and row["sequences"] > row["requests"]          # n=4 requests forked
    assert row["capture_ms_median"] > 0 and row["full_json_bytes"] > 400 * 20
