"""Tensor parallelism (executor/, models/sharding.py): N ranks, each in its own process
with its shard, give the tokens and logprobs of one process and of transformers; a rank
that dies fails the engine with an error naming it and leaves no process behind."""
from __future__ import annotations

import os
import signal
import time

import psutil
import pytest
import torch

from pagedserve import LLM, BeamSearchParams, SamplingParams
from pagedserve.executor import WorkerFailedError
from tests.conftest import hf_greedy

PROMPTS = ["The quick brown fox", "Paged attention stores keys", "def add(a, b):", "Once upon a time there was"]


def _llm(path: str, tp: int, **kw) -> LLM:
    kw.setdefault("num_gpu_blocks_override", 128)
    return LLM(path, dtype="float32", tensor_parallel_size=tp, **kw)


def _gone(pids: list[int], timeout: float = 60.0) -> bool:
    """None of these processes runs (within `timeout`: one that saw its parent go exits by itself)."""
    def running(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False
    deadline = time.monotonic() + timeout
    while any(running(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@pytest.mark.parametrize("name,tp", [("llama_gqa_untied", 2),     # 4 query / 2 KV heads: one KV head each
                                     ("llama_gqa_untied", 4),     # KV heads < ranks: replicated
                                     ("llama_tp3", 3)])           # 3 heads / 1 KV head; vocab 400 in padded parts
def test_greedy_tokens_and_logprobs_match_one_process_and_transformers(tiny_models, name, tp):
    tm = tiny_models(name)
    tok = tm.tokenizer
    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=12, logprobs=3)
    one = _llm(tm.path, 1)
    ref = one.generate(PROMPTS, params, use_tqdm=False)
    llm = _llm(tm.path, tp)
    try:
        pids = llm.engine.executor.worker_pids()
        assert len(pids) == tp - 1 and all(psutil.pid_exists(p) for p in pids)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        for prompt, a, b in zip(PROMPTS, ref, outs):
            assert b.outputs[0].token_ids == a.outputs[0].token_ids == hf_greedy(tm.hf, tok.encode(prompt), 12)
            for lp_a, lp_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
                assert lp_a.keys() == lp_b.keys()
                for t in lp_a:
                    assert lp_b[t].logprob == pytest.approx(lp_a[t].logprob, abs=1e-4)
        # The driver holds one rank's shard: its heads, MLP part and vocabulary part.
        whole, part = (_weight_elements(x.engine.runner.model) for x in (one, llm))
        assert part < whole / tp * 1.2
    finally:
        llm.shutdown()
    assert _gone(pids)


def _weight_elements(model) -> int:
    tensors = [model.embed, model.lm_head, model.norm]
    for w in model.layers:
        tensors += [w.qkv, w.o, w.gate_up, w.down, w.input_norm, w.post_norm]
    return sum(getattr(t, "data", t).numel() for t in tensors)


def _sharing_workload(llm: LLM):
    """Parallel sampling, best_of, beam search, prefix-cache hits, seeded: what each gives."""
    common = "Paged attention stores keys and values in fixed-size blocks. " * 3
    prompts = [common + p for p in PROMPTS]
    sampled = llm.generate(prompts, SamplingParams(n=3, temperature=0.9, max_tokens=16, seed=7, logprobs=1),
                           use_tqdm=False)
    best_of = llm.generate(PROMPTS[:2], SamplingParams(n=2, best_of=4, temperature=1.0, max_tokens=10, seed=3),
                           use_tqdm=False)
    beams = llm.beam_search(PROMPTS[:2], BeamSearchParams(beam_width=3, max_tokens=10))
    stats = llm.kv_cache_stats()
    return ([[c.token_ids for c in o.outputs] for o in sampled + best_of],
            [[s.tokens for s in b.sequences] for b in beams], stats)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_sharing_and_preemption_under_tp2_match_one_process(tiny_llama, mode):
    """Copy-on-write (n > 1, best_of, beam search), prefix-cache hits and a preemption storm
    (few blocks, many sequences) give the same tokens with 2 ranks as with one."""
    kw = dict(num_gpu_blocks_override=24, max_num_seqs=32, preemption_mode=mode)
    if mode == "swap":
        kw["num_host_blocks_override"] = 64
    one = _llm(tiny_llama.path, 1, **kw)
    tokens, beams, stats = _sharing_workload(one)
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    if mode == "swap":
        assert stats["num_swapped_out_blocks"] > 0
    llm = _llm(tiny_llama.path, 2, **kw)
    try:
        tp_tokens, tp_beams, tp_stats = _sharing_workload(llm)
    finally:
        llm.shutdown()
    assert tp_tokens == tokens and tp_beams == beams
    for key in ("num_preemptions", "prefix_cache_hits", "num_swapped_out_blocks", "num_swapped_in_blocks"):
        assert tp_stats[key] == stats[key], key


def test_killed_rank_fails_the_engine_naming_it_and_leaves_no_process(tiny_models):
    llm = _llm(tiny_models("llama_tp3").path, 3, distributed_timeout=30)
    pids = llm.engine.executor.worker_pids()
    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)
    os.kill(pids[0], signal.SIGKILL)      # rank 1
    with pytest.raises(WorkerFailedError, match=r"rank 1 \(pid \d+\) died \(killed by signal SIGKILL\)") as e:
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)
    assert e.value.rank == 1
    assert _gone(pids)                    # rank 2 stopped too
    with pytest.raises(WorkerFailedError):   # the engine stays failed
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)
    llm.shutdown()


def test_hung_rank_fails_the_step_after_the_timeout_instead_of_hanging(tiny_llama):
    llm = _llm(tiny_llama.path, 2, distributed_timeout=3)
    pids = llm.engine.executor.worker_pids()
    os.kill(pids[0], signal.SIGSTOP)      # rank 1 stops answering
    try:
        with pytest.raises(WorkerFailedError, match="no other rank died or raised.*distributed_timeout=3"):
            llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)
    finally:
        llm.shutdown()
    assert _gone(pids)                    # killed, stopped as it was


def test_model_that_does_not_split_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="tensor_parallel_size 3 must divide the model's 4 attention heads"):
        _llm(tiny_llama.path, 3)
    # The refused engine left nothing behind: another can start.
    llm = _llm(tiny_llama.path, 2)
    llm.shutdown()


def test_gguf_slices_are_the_whole_tensors_parts():
    """A rank reads its rows (whole heads, un-permuted per head) and columns (whole quant
    blocks) straight from the GGUF file: the same values as slicing the whole tensor."""
    import gguf

    from pagedserve.models.loader import GGUFSource, args_from_gguf, default_model_path
    try:
        reader = gguf.GGUFReader(default_model_path())
    except FileNotFoundError as e:
        pytest.skip(str(e))
    source = GGUFSource(reader, args_from_gguf(reader))
    for name, rows, cols in [("layers.0.self_attn.q_proj.weight", (192, 384), None),
                             ("layers.1.self_attn.k_proj.weight", (64, 128), None),
                             ("layers.0.self_attn.o_proj.weight", None, (384, 576)),
                             ("layers.2.mlp.down_proj.weight", None, (512, 1024)),
                             ("embed_tokens.weight", (16384, 32768), None)]:
        whole = source.get(name)
        expected = whole[rows[0]:rows[1]] if rows else whole[:, cols[0]:cols[1]]
        assert torch.equal(source.get(name, rows, cols), expected), name


def test_server_with_two_ranks_serves_openai_and_exits_1_when_a_rank_dies(tiny_llama, tmp_path):
    """`serve --tensor-parallel-size 2` answers the official client like one process; when
    rank 1 is killed the request fails, /health is no longer 200, the server exits 1 and
    neither it nor a rank is left running."""
    import httpx
    from openai import OpenAI

    from pagedserve.server.launcher import launch_server
    from tests.server_utils import tiny_server_args
    server = launch_server(tiny_llama.path, tiny_server_args("--tensor-parallel-size", "2"), tmp_path / "server.log")
    try:
        children = [c.pid for c in psutil.Process(server.proc.pid).children(recursive=True)]
        client = OpenAI(base_url=server.url + "/v1", api_key="x")
        out = client.completions.create(model=tiny_llama.path, prompt=PROMPTS[0], max_tokens=8, temperature=0)
        one = _llm(tiny_llama.path, 1).generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=8),
                                                 use_tqdm=False)[0]
        assert out.choices[0].text == one.outputs[0].text
        rank1 = [p for p in children if "spawn_main" in " ".join(psutil.Process(p).cmdline())]
        assert len(rank1) == 1
        os.kill(rank1[0], signal.SIGKILL)
        r = httpx.post(server.url + "/v1/completions", json={"model": tiny_llama.path, "prompt": PROMPTS[1],
                                                             "max_tokens": 8}, timeout=60)
        assert r.status_code in (500, 503)
        assert server.proc.wait(60) == 1
    finally:
        server.stop()
    assert "tensor-parallel rank 1" in server.log() and "died (killed by signal SIGKILL)" in server.log()
    assert _gone(children)      # rank 1 and multiprocessing's helper (resource tracker)


def test_ray_backend_matches_one_process_and_names_a_dead_rank(tiny_llama, ray_cluster):
    """Rank 1 as a Ray actor (placement group on the local Ray instance): the same greedy
    tokens as one process; killing it fails the engine with an error naming rank 1."""
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=1)
    ref = _llm(tiny_llama.path, 1).generate(PROMPTS, params, use_tqdm=False)
    llm = _llm(tiny_llama.path, 2, distributed_executor_backend="ray")
    try:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
        pids = llm.engine.executor.worker_pids()
        os.kill(pids[0], signal.SIGKILL)
        with pytest.raises(WorkerFailedError, match=r"rank 1 \(pid \d+\) died") as e:
            llm.generate(PROMPTS[:1], params, use_tqdm=False)
        assert e.value.rank == 1
    finally:
        llm.shutdown()
    assert _gone(pids)
