"""engine/async_llm.py on its own, in this process (no server): streams, output kinds, aborts,
the queue limit, the front-end tokenizer, and the step-failure policy (LLMEngine.recover) as
the server's driver applies it. Tokens are compared with the offline LLM's."""
from __future__ import annotations

import asyncio
import threading

import pytest

from pagedserve import SamplingParams
from pagedserve.config import EngineConfig
from pagedserve.engine.async_llm import (AsyncLLM, EngineDeadError, EngineNotReadyError, EngineStepError,
                                         QueueFullError, delta_output)
from pagedserve.engine.llm_engine import MAX_STEP_FAILURES
from pagedserve.engine.protocol import EngineClient
from pagedserve.engine.tokenizer import front_end_tokenizer
from pagedserve.errors import InvalidRequestError
from pagedserve.outputs import CompletionOutput
from pagedserve.sampling_params import RequestOutputKind
from tests.fault_server import SLOW_STEPS
from tests.fault_server import install as install_faults
from tests.test_engine import make_llm

PROMPT = "Once upon a time"
GREEDY = dict(temperature=0, ignore_eos=True, max_tokens=6)


def async_llm(tiny_llama, **kw) -> AsyncLLM:
    extra = {k: kw.pop(k) for k in ("max_waiting_requests",) if k in kw}
    kw.setdefault("num_gpu_blocks_override", 64)
    config = EngineConfig(model=tiny_llama.path, dtype="float32", check_invariants=True, **kw)
    return AsyncLLM(config, log_interval=None, **extra)


def run(llm: AsyncLLM, body) -> None:
    async def main():
        llm.start()
        await llm.wait_started()
        try:
            await body()
        finally:
            await llm.shutdown()
    asyncio.run(main())


async def collect(llm: AsyncLLM, rid: str, params: SamplingParams, prompt=PROMPT) -> list:
    return [out async for out in llm.generate(prompt, params, rid)]


def test_delta_output_yields_what_was_not_sent():
    sent: dict = {}
    first = delta_output(CompletionOutput(0, "Once", [1], None, [{1: None}]), sent)
    second = delta_output(CompletionOutput(0, "Once upon", [1, 2], None, [{1: None}, {2: None}]), sent)
    assert (first.text, first.token_ids) == ("Once", [1])
    assert (second.text, second.token_ids, len(second.logprobs)) == (" upon", [2], 1)


def test_outputs_match_the_offline_engine_in_every_output_kind(tiny_llama):
    ref = make_llm(tiny_llama, num_gpu_blocks_override=64).generate(PROMPT, SamplingParams(**GREEDY),
                                                                     use_tqdm=False)[0].outputs[0]
    llm = async_llm(tiny_llama)

    async def body():
        assert isinstance(llm, EngineClient)
        cumulative = await collect(llm, "c", SamplingParams(**GREEDY))
        assert cumulative[-1].finished and cumulative[-1].outputs[0].token_ids == ref.token_ids
        assert cumulative[-1].outputs[0].text == ref.text
        delta = await collect(llm, "d", SamplingParams(**GREEDY, output_kind=RequestOutputKind.DELTA))
        assert sum((o.outputs[0].token_ids for o in delta), []) == ref.token_ids
        assert "".join(o.outputs[0].text for o in delta) == ref.text
        final = await collect(llm, "f", SamplingParams(**GREEDY, output_kind=RequestOutputKind.FINAL_ONLY))
        assert len(final) == 1 and final[0].outputs[0].token_ids == ref.token_ids
        assert not llm.engine.requests
    run(llm, body)


def test_the_front_end_tokenizer_is_the_processs_one_and_not_the_engines(tiny_llama):
    llm = async_llm(tiny_llama)

    async def body():
        assert llm.tokenizer is front_end_tokenizer(llm.engine.tokenizer_path)
        assert llm.tokenizer is not llm.engine.tokenizer      # the engine thread keeps its own
        assert llm.tokenizer.encode(PROMPT) == llm.engine.tokenizer.encode(PROMPT)
    run(llm, body)


def test_an_abort_ends_the_stream_with_abort_and_frees_the_blocks(tiny_llama):
    llm = async_llm(tiny_llama)

    async def body():
        stream = await llm.add_requests([("a", PROMPT, SamplingParams(temperature=0, ignore_eos=True,
                                                                      max_tokens=200))])
        outs = []
        async for out in stream:
            outs.append(out)
            if len(outs) == 2:
                stream.abort()
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
        await asyncio.sleep(0.05)
        assert llm.engine.kv_cache_stats()["num_used_blocks"] == 0
    run(llm, body)


def test_the_queue_limit_refuses_a_call_that_could_never_fit_and_one_that_overflows(tiny_llama):
    llm = async_llm(tiny_llama, max_waiting_requests=2)

    async def body():
        with pytest.raises(ValueError, match="at most 2"):
            llm.check_num_prompts(3)
        llm.check_num_prompts(2)
        items = [(f"r{i}", PROMPT, SamplingParams(**GREEDY)) for i in range(3)]
        with pytest.raises(ValueError, match="at most 2"):   # the same check, on the way in
            await llm.add_requests(items)
        first = await llm.add_requests(items[:2])
        with pytest.raises(QueueFullError):
            await llm.add_requests(items[2:])
        async for _ in first:
            pass
        with pytest.raises(ValueError, match="already in use"):
            await llm.add_requests([items[0], items[0]])
    run(llm, body)


@pytest.mark.parametrize("where", ["event loop", "engine thread"])
def test_a_bad_request_is_refused_as_bad_whatever_the_queues_state(tiny_llama, monkeypatch, where):
    """A full queue refuses a valid request (retry later) but an invalid one as invalid: a prompt
    longer than the model's length (as ids, as text, as more characters than the context could
    hold), n over max_num_seqs, min_tokens over the context's room, more KV blocks than the
    cache has (24 blocks of 16: 384 tokens, under the model's 512).
    Both queue checks: the event loop's first one, and the engine thread's exact one (made the
    only one here by passing the event loop's). One request runs, slowed, two wait."""
    install_faults(monkeypatch.setattr)
    if where == "engine thread":
        check_queue = AsyncLLM._check_queue
        monkeypatch.setattr(AsyncLLM, "_check_queue", lambda self, *a: check_queue(self, *a)
                            if threading.current_thread().name == "pagedserve-engine" else None)
    llm = async_llm(tiny_llama, max_waiting_requests=2, max_num_seqs=1, num_gpu_blocks_override=24)
    slow = SamplingParams(temperature=0, ignore_eos=True, max_tokens=300)

    async def body():
        running = await llm.add_requests([("run", f"{PROMPT} {SLOW_STEPS}", slow)])
        await running.__aiter__().__anext__()        # it runs: the next two wait
        # One at a time: the first check counts on what the engine last reported, which may
        # still hold "run" as waiting (one more, never more: its first output came).
        waiting = [await llm.add_requests([(f"w{i}", f"{PROMPT} {SLOW_STEPS}", slow)]) for i in range(2)]
        assert llm.engine.scheduler.queues.num_waiting == 2
        too_long = {"prompt_token_ids": [5] * (llm.max_model_len + 10)}
        for rid, prompt, params, words in [
                ("long", too_long, SamplingParams(**GREEDY), "maximum context length"),
                ("n", PROMPT, SamplingParams(n=2, temperature=1.0, max_tokens=2), "max_num_seqs"),
                ("min", {"prompt_token_ids": [5] * (llm.max_model_len - 4)},
                 SamplingParams(max_tokens=None, min_tokens=8), "min_tokens"),
                ("text", " x" * llm.max_model_len, SamplingParams(**GREEDY), "maximum context length"),
                ("chars", {"prompt": "x" * 10**5}, SamplingParams(**GREEDY),   # the engine tokenizes it
                 "characters long" if where == "event loop" else "tokens long"),
                ("kv", PROMPT, SamplingParams(temperature=0, max_tokens=450), "never fit in the KV cache")]:
            with pytest.raises(InvalidRequestError, match=words):
                await llm.add_requests([(rid, prompt, params)])
        with pytest.raises(QueueFullError):
            await llm.add_requests([("ok", PROMPT, SamplingParams(**GREEDY))])
        assert set(llm.engine.requests) == {"run", "w0", "w1"}
        for stream in [running, *waiting]:
            stream.close()
    run(llm, body)


def test_a_bad_request_is_refused_and_nothing_is_left_behind(tiny_llama):
    llm = async_llm(tiny_llama)

    async def body():
        with pytest.raises(ValueError, match="min_tokens"):
            await llm.add_requests([("ok", PROMPT, SamplingParams(**GREEDY)),
                                    ("bad", PROMPT, SamplingParams(max_tokens=2, min_tokens=5))])
        await asyncio.sleep(0.05)
        assert not llm.engine.requests and llm.engine.kv_cache_stats()["num_used_blocks"] == 0
    run(llm, body)


def test_not_started_is_not_ready():
    llm = AsyncLLM(EngineConfig(), log_interval=None)

    async def body():
        with pytest.raises(EngineNotReadyError):
            await llm.add_requests([("r", PROMPT, SamplingParams())])
    asyncio.run(body())


def test_failed_steps_fail_the_requests_in_flight_then_kill_the_engine(tiny_llama, monkeypatch):
    """LLMEngine.recover's policy as AsyncLLM applies it: a step that fails as a whole fails the
    requests in flight (EngineStepError) and the engine goes on; MAX_STEP_FAILURES in a row
    kill it (EngineDeadError, wait_dead returns, new requests are refused)."""
    llm = async_llm(tiny_llama)

    async def body():
        real_step = llm.engine.step
        failures = {"left": 1}

        def step():
            if failures["left"] > 0:
                failures["left"] -= 1
                raise RuntimeError("injected step fault")
            return real_step()
        monkeypatch.setattr(llm.engine, "step", step)
        with pytest.raises(EngineStepError, match="injected"):
            await collect(llm, "one", SamplingParams(**GREEDY))
        assert len((await collect(llm, "two", SamplingParams(**GREEDY)))[-1].outputs[0].token_ids) == 6
        failures["left"] = MAX_STEP_FAILURES
        errors = []
        for i in range(MAX_STEP_FAILURES):
            try:
                await collect(llm, f"doomed{i}", SamplingParams(**GREEDY))
            except (EngineStepError, EngineDeadError) as e:
                errors.append(type(e))
        assert errors == [EngineStepError] * (MAX_STEP_FAILURES - 1) + [EngineDeadError]
        error = await asyncio.wait_for(llm.wait_dead(), 30)
        assert isinstance(error, EngineDeadError) and llm.state == "dead"
        with pytest.raises(EngineNotReadyError):
            await llm.add_requests([("late", PROMPT, SamplingParams(**GREEDY))])
    run(llm, body)


def _os_thread_ids() -> set[str]:
    """The process's OS threads now (other libraries' threads may end meanwhile: compare sets)."""
    import os
    return set(os.listdir("/proc/self/task"))


def _new_threads_left(before: set[str], timeout: float = 30.0) -> set[str]:
    """The OS threads not in `before` once they are gone, or still there after `timeout` s: a
    joined thread may still be listed for a moment (the kernel reaps it after its join returns)."""
    import time
    deadline = time.monotonic() + timeout
    while (new := _os_thread_ids() - before) and time.monotonic() < deadline:
        time.sleep(0.01)
    return new


def test_release_thread_team_ends_the_calling_threads_openmp_workers():
    """libgomp keeps a thread's OpenMP workers until it exits; release_thread_team ends them now."""
    import threading

    import torch

    from pagedserve.kernels.threads import release_thread_team, set_thread_count
    counts = []

    def body():
        set_thread_count(2)
        before = _os_thread_ids()
        torch.ones(1 << 22).sum()            # an OpenMP parallel region: one worker joins this thread
        counts.extend([before, _os_thread_ids(), release_thread_team(), _new_threads_left(before)])
    t = threading.Thread(target=body)
    t.start()
    t.join()
    before, busy, released, left = counts
    assert released and len(busy - before) == 1 and not left


def test_an_idle_engine_hands_back_its_openmp_workers_while_another_runs(tiny_llama, monkeypatch):
    """With several engines in a process (a multi-model server), libgomp counts every engine's
    workers against the CPUs and stops spinning at barriers: an idle engine hands its workers
    back; an engine alone keeps them."""
    import threading

    import pagedserve.engine.async_llm as async_module
    released: list[threading.Thread] = []
    real = async_module.release_thread_team

    def recording() -> bool:
        done = real()
        released.append(threading.current_thread())     # once the workers are ended
        return done
    monkeypatch.setattr(async_module, "release_thread_team", recording)
    a, b = async_llm(tiny_llama, num_threads=2), async_llm(tiny_llama, num_threads=2)

    async def wait_for(count: int) -> None:
        for _ in range(3000):                                  # (30 s: returns once they came)
            if len(released) >= count:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"{len(released)} releases, expected {count}")

    async def main():
        a.start()
        await a.wait_started()
        await collect(a, "a1", SamplingParams(**GREEDY))
        await asyncio.sleep(0.1)
        assert released == []                                  # alone: it keeps its workers
        b.start()
        await b.wait_started()                                 # b's start wakes a, which hands back
        await wait_for(2)
        assert set(released) == {a._thread, b._thread}        # b after its load, a once woken
        threads = _os_thread_ids()
        await collect(b, "b1", SamplingParams(**GREEDY))        # b steps (its workers start), then idles
        await wait_for(3)
        assert released[2] is b._thread and not _new_threads_left(threads)   # its workers ended
        await a.shutdown()
        await collect(b, "b2", SamplingParams(**GREEDY))        # alone again: keeps them
        await asyncio.sleep(0.1)
        assert len(released) == 3
        await b.shutdown()
    asyncio.run(main())
