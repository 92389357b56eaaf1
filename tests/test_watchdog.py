"""The engine's watchdog: a scheduler that stops making progress fails the requests it
holds, with a clear error, instead of spinning forever; the engine frees their blocks and
goes on serving.

The fault is injected into a real scheduler (its schedule() starts returning empty steps
after a few real ones, so blocks are held when it stalls); the paging invariants are
checked after every step as in all engine tests.
"""
import asyncio
import logging

import pytest

from pagedserve import SamplingParams
from pagedserve.config import EngineConfig
from pagedserve.engine.async_llm import AsyncLLM, EngineStepError
from pagedserve.engine.llm_engine import EngineStalledError
from pagedserve.scheduler import SchedulerOutput
from tests.test_engine import assert_no_blocks_held, make_llm

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [5, 6, 7, 8, 9]}, {"prompt_token_ids": [10, 11, 12]}]


def stall_after(scheduler, num_real_steps: int) -> None:
    """From the (num_real_steps+1)-th call on, schedule() runs nothing: a scheduler bug."""
    real = scheduler.schedule
    calls = 0

    def schedule():
        nonlocal calls
        calls += 1
        return real() if calls <= num_real_steps else SchedulerOutput()
    scheduler.schedule = schedule


def test_a_stalled_engine_fails_its_requests_and_serves_new_ones(tiny_llama, caplog):
    llm = make_llm(tiny_llama, watchdog_steps=5)
    expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    stall_after(llm.engine.scheduler, 2)
    with caplog.at_level(logging.ERROR, logger="pagedserve.engine.llm_engine"):
        with pytest.raises(EngineStalledError, match="no progress in 5 steps .* 2 unfinished requests"):
            llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    state = next(r.getMessage() for r in caplog.records if "watchdog" in r.getMessage())
    # The queues, each sequence's computed / total tokens, the free blocks.
    assert "running (2)" in state and "waiting (0)" in state and "free blocks" in state
    assert "[6/7]" in state and "[4/5]" in state  # prompt and one token computed, the next not
    assert not llm.engine.requests
    assert_no_blocks_held(llm)
    # The failed step started the KV bookkeeping afresh (a new scheduler): the fault went with it.
    assert "schedule" not in vars(llm.engine.scheduler)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)] == expected
    assert_no_blocks_held(llm)


def test_the_server_engine_fails_stalled_requests_and_goes_on(tiny_llama):
    """AsyncLLM (the server's engine thread): the stalled requests' streams end with the
    error; a request sent after that is served."""
    llm = AsyncLLM(EngineConfig(model=tiny_llama.path, dtype="float32", num_gpu_blocks_override=256,
                                watchdog_steps=5, check_invariants=True), log_interval=None)

    async def run(rid: str) -> list[int]:
        final = None
        async for out in llm.generate(PROMPTS[0], PARAMS, rid):
            final = out
        return final.outputs[0].token_ids

    async def main():
        llm.start()
        await llm.wait_started()
        try:
            stall_after(llm.engine.scheduler, 1)   # the engine thread is idle: no request yet
            with pytest.raises(EngineStepError, match="no progress in 5 steps"):
                await run("stalled")
            assert not llm.engine.requests and llm.engine.kv_cache_stats()["num_used_blocks"] == 0
            assert "schedule" not in vars(llm.engine.scheduler)   # reset after the failed step
            assert len(await run("after")) == PARAMS.max_tokens
        finally:
            await llm.shutdown()

    asyncio.run(main())


def test_watchdog_steps_is_validated():
    with pytest.raises(ValueError, match="watchdog_steps must be >= 0"):
        EngineConfig(watchdog_steps=-1)
