"""One validation path: every refusal of a request is an InvalidRequestError naming the
OpenAI parameter at fault (None: the prompt as a whole), raised before anything is allocated."""
import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.errors import InvalidRequestError
from pagedserve.sampling_params import BeamSearchParams


@pytest.mark.parametrize("kwargs,param", [
    (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(max_tokens=0), "max_tokens"),
    (dict(n=0), "n"), (dict(n=2, best_of=1), "best_of"), (dict(top_k=-5), "top_k"), (dict(min_p=2.0), "min_p"),
    (dict(logprobs=-1), "logprobs"), (dict(prompt_logprobs=-1), "prompt_logprobs"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"), (dict(bad_words=[""]), "bad_words"),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"), (dict(logits_processors=[print]), "logits_processors"),
    (dict(presence_penalty=3.0), "presence_penalty"), (dict(frequency_penalty=3.0), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    (dict(stop=[""]), "stop"), (dict(logit_bias={1: 500}), "logit_bias"), (dict(seed="x"), "seed"),
    (dict(n=1, best_of=2, temperature=0), "best_of"),
])
def test_sampling_params_name_the_parameter(kwargs, param):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param and str(e.value).startswith(param)


@pytest.mark.parametrize("kwargs,param", [(dict(beam_width=0), "beam_width"), (dict(beam_width=2, max_tokens=0),
                                          "max_tokens"), (dict(beam_width=2, length_penalty=1e9), "length_penalty")])
def test_beam_search_params_name_the_parameter(kwargs, param):
    with pytest.raises(InvalidRequestError) as e:
        BeamSearchParams(**kwargs)
    assert e.value.param == param


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(tiny_llama.path, dtype="float32", num_gpu_blocks_override=16, block_size=4, max_model_len=64,
               max_num_seqs=2)


@pytest.mark.parametrize("prompt,params,param,code,words", [
    ([5] * 64, SamplingParams(), "prompt", "context_length_exceeded", ["64 tokens"]),
    ([], SamplingParams(), "prompt", None, ["empty"]),
    ([1, 10**6], SamplingParams(), "prompt", None, ["vocabulary"]),
    ([1, 2], SamplingParams(stop_token_ids=[10**6]), "stop_token_ids", None, ["vocabulary"]),
    ([1, 2], SamplingParams(logit_bias={10**6: 1}), "logit_bias", None, ["vocabulary"]),
    ([1, 2], SamplingParams(allowed_token_ids=[3, 10**6]), "allowed_token_ids", None, ["vocabulary"]),
    ([1, 2], SamplingParams(logprobs=21), "logprobs", None, ["max_logprobs (20)"]),
    ([1, 2], SamplingParams(prompt_logprobs=21), "prompt_logprobs", None, ["max_logprobs (20)"]),
    ([1, 2], SamplingParams(n=3, temperature=1), "n", None, ["max_num_seqs=2"]),
    ([1, 2], SamplingParams(n=1, best_of=3, temperature=1), "best_of", None, ["max_num_seqs=2"]),
    ([1, 2], BeamSearchParams(beam_width=3), "n", None, ["max_num_seqs=2"]),
    ([1] * 20, SamplingParams(n=2, temperature=1, max_tokens=40), None, None, ["never fit", "has 16"]),
    ([1] * 60, SamplingParams(max_tokens=None, min_tokens=10), "min_tokens", None, ["max_tokens (4)"]),
])
def test_the_engine_refuses_with_the_parameter_named(llm, prompt, params, param, code, words):
    with pytest.raises(InvalidRequestError) as e:
        llm.engine.add_request(None, {"prompt_token_ids": prompt}, params)
    assert (e.value.param, e.value.code) == (param, code)
    assert all(w in str(e.value) for w in words), str(e.value)
    assert not llm.engine.has_unfinished_requests() and llm.kv_cache_stats()["num_used_blocks"] == 0


def test_max_tokens_is_resolved_in_one_place(llm):
    """None means up to the context, for sampling and beam search alike; a larger number is cut."""
    for params in (SamplingParams(max_tokens=None), SamplingParams(max_tokens=1000),
                   BeamSearchParams(beam_width=1, max_tokens=None)):
        req = llm.engine.add_request(None, {"prompt_token_ids": [1] * 10}, params)
        assert req.max_tokens == 64 - 10
        llm.engine.abort_request(req.request_id)


def test_capacity_is_checked_once_per_request_on_every_path(tiny_llama, monkeypatch):
    """Scheduler.check_request (max_num_seqs, the KV cache's fit) runs once per request, and on
    every path in: the offline LLM, AsyncLLM, the server (in process); a request that could never
    fit is still refused on each (issue 51: it ran twice, in check_request and add_request)."""
    import asyncio

    import httpx

    from pagedserve.config import EngineConfig
    from pagedserve.engine.async_llm import AsyncLLM
    from pagedserve.scheduler import Scheduler
    from pagedserve.server.app import build_app
    from pagedserve.server.metrics import PrometheusStatLogger
    from pagedserve.server.state import ServerState

    checked: list[str] = []
    check = Scheduler.check_request

    def counted(self, req):
        checked.append(req.request_id)
        return check(self, req)
    monkeypatch.setattr(Scheduler, "check_request", counted)
    kw = dict(model=tiny_llama.path, dtype="float32", num_gpu_blocks_override=16, block_size=4, max_model_len=64)
    too_big = SamplingParams(n=2, temperature=1, max_tokens=40)   # 2 x 40 tokens: more than 16 blocks of 4

    offline = LLM(**kw)
    outs = offline.generate(["one", "two"], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(checked) == 2 and sorted(checked) == sorted(o.request_id for o in outs)
    with pytest.raises(InvalidRequestError, match="never fit"):
        offline.generate(["one"], too_big, use_tqdm=False)
    assert len(checked) == 3

    async def served():
        state = ServerState(AsyncLLM(EngineConfig(**kw), log_interval=None), ["tiny"], PrometheusStatLogger("tiny"))
        app = build_app(state)
        async with app.router.lifespan_context(app):
            await state.llm.wait_started()
            stream = await state.llm.add_requests([("a1", "one", SamplingParams(max_tokens=2)),
                                                   ("a2", "two", SamplingParams(max_tokens=2))])
            async for _ in stream:
                pass
            with pytest.raises(InvalidRequestError, match="never fit"):
                await state.llm.add_requests([("a3", "one", too_big)])
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t",
                                         timeout=60) as c:
                ok = await c.post("/v1/completions", json={"prompt": "one", "max_tokens": 2})
                bad = await c.post("/v1/completions", json={"prompt": "one", "n": 2, "max_tokens": 40})
            return ok, bad

    ok, bad = asyncio.run(served())
    assert ok.status_code == 200 and bad.status_code == 400 and "never fit" in bad.json()["error"]["message"]
    assert checked[3:6] == ["a1", "a2", "a3"] and len(checked) == 8, checked
    assert len(set(checked[6:])) == 2     # the server's two requests: once each
