"""Data-parallel serving end to end: `serve --data-parallel-size 2` on the tiny model, two
Ray-actor replicas joined to the test run's Ray instance, driven by the official openai
client. Few tests, one server (starting replicas is the slow part)."""
import threading

import httpx
import openai
import pytest

from pagedserve import LLM, BeamSearchParams, SamplingParams
from tests.conftest import wait_for
from tests.server_utils import API_KEY, KV_BLOCKS, PROMPT, api_server_args, metrics, served, sse_events

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def server(tiny_llama, ray_address, tmp_path_factory):
    yield from served(tiny_llama.path, tmp_path_factory.mktemp("dp"),
                      api_server_args("--data-parallel-size", "2", "--ray-address", ray_address), timeout=300)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def offline(tiny_llama):
    return LLM(tiny_llama.path, dtype="float32", num_gpu_blocks_override=KV_BLOCKS)


def replicas() -> list:
    """The server's replica actors, by engine index."""
    names = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "-replica-" in a["name"])
    assert len(names) == 2, names
    return [ray.get_actor(n, namespace="pagedserve") for n in names]

WAIT_S = 120.0   # seconds a wait for the cluster may take (a hang fails; never asserted on as a speed)


def engine(m: dict, name: str, i: int, **labels) -> float:
    extra = "".join(f',{k}="{v}"' for k, v in labels.items())
    return m[f'pagedserve:{name}{{engine="{i}"{extra}}}']


def finished(m: dict) -> float:
    """Requests the replicas have finished (any reason), from their stats."""
    return sum(v for k, v in m.items() if k.startswith("pagedserve:request_success_total"))


def wait_synced(http, num_finished: float | None = None) -> dict:
    """Both replicas idle, the router's index as large as each replica's real cache, and (if
    given) num_finished requests finished: the polls have caught up with the replicas."""
    def synced():
        m = metrics(http)
        sizes = ray.get([r.cached_block_keys.remote() for r in replicas()])
        ok = all(engine(m, "num_requests_running", i) == 0 and engine(m, "kv_cache_usage_perc", i) == 0
                 and engine(m, "router_indexed_blocks", i) == len(sizes[i]) for i in range(2))
        return m if ok and (num_finished is None or finished(m) == num_finished) else None
    return wait_for(synced, "the router's index to catch up", timeout=WAIT_S, interval=0.05)


def test_streaming_n2_chat_tokenize_and_metrics_through_the_router(server, client, http, offline):
    ref = offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)[0]
    stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, n=2, stream=True,
                                       extra_body={"ignore_eos": True})
    texts = {0: "", 1: ""}
    chunks = 0
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
        chunks += 1
    assert texts == {0: ref.outputs[0].text, 1: ref.outputs[0].text}
    # Tokens came in more than one piece: how many depends on how the server coalesces deltas a
    # slow reader has not taken yet, so only "streamed, not all at once" is asserted.
    assert chunks >= 2
    reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=8, temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length") and reply.usage.completion_tokens >= 1
    assert http.post("/tokenize", json={"prompt": PROMPT}).json()["count"] == len(ref.prompt_token_ids)
    # Two prompts in one request: each routed on its own, answered in order.
    refs = offline.generate([PROMPT, "Keys and values"], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                            use_tqdm=False)
    r = client.completions.create(model="tiny", prompt=[PROMPT, "Keys and values"], max_tokens=5, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == [o.outputs[0].text for o in refs]
    # Beam search and logprobs come back from the replica as the offline engine gives them.
    beams = offline.beam_search([PROMPT], BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True))[0]
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, n=2, best_of=3,
                                  extra_body={"use_beam_search": True, "ignore_eos": True})
    assert [c.text for c in r.choices] == [s.text for s in beams.sequences[:2]]
    want = offline.generate(PROMPT, SamplingParams(temperature=0, max_tokens=4, logprobs=2), use_tqdm=False)[0]
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2)
    got = r.choices[0].logprobs.token_logprobs
    assert got == pytest.approx([lp[t].logprob for t, lp in zip(want.outputs[0].token_ids, want.outputs[0].logprobs)],
                                abs=1e-4)
    assert httpx.post(server.url + "/v1/completions", json={"prompt": "x"}).status_code == 401
    bad = client.with_options(max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:       # the replica's validation, as a 400 naming the param
        bad.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, extra_body={"min_p": 2.0})
    assert e.value.body["param"] == "min_p"
    m = wait_synced(http)
    for i in range(2):
        assert engine(m, "router_replica_up", i) == 1
        assert f'pagedserve:request_success_total{{engine="{i}",finished_reason="length"}}' in m
    assert sum(engine(m, "request_success_total", i, finished_reason="length") for i in range(2)) >= 2


def test_repeated_long_prefix_lands_on_the_replica_that_holds_it(http, client):
    system = "You are a careful assistant who answers in full sentences. " * 12
    done = finished(wait_synced(http))
    client.completions.create(model="tiny", prompt=system + "First question?", max_tokens=2, temperature=0)
    before = wait_synced(http, done + 1)
    holder = max(range(2), key=lambda i: engine(before, "router_indexed_blocks", i))
    for k, q in enumerate(("Second question?", "A third one.", "And the last")):
        client.completions.create(model="tiny", prompt=system + q, max_tokens=2, temperature=0)
        after = wait_synced(http, done + 2 + k)
    hits = [engine(after, "prefix_cache_hits_total", i) - engine(before, "prefix_cache_hits_total", i)
            for i in range(2)]
    assert hits[holder] >= 3 * 16 * 10 and hits[1 - holder] == 0, hits
    routed = lambda m: sum(v for k, v in m.items() if k.startswith("pagedserve:router_requests_total")  # noqa
                           and 'decision="prefix"' in k)
    assert routed(after) - routed(before) == 3
    est, act = "pagedserve:router_estimated_prefix_hit_tokens_total", "pagedserve:router_actual_prefix_hit_tokens_total"
    assert after[est] - before[est] == after[act] - before[act] == hits[holder]


def test_disconnect_aborts_the_request_on_its_replica(http):
    """The client leaves after its first tokens: the request is aborted on its replica. The
    replicas' steps cannot be slowed from here, so a request that a fast machine finished
    before the disconnect reached its replica (it ends with "length") is tried again."""
    body = {"prompt": PROMPT, "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
    aborts = lambda m: sum(engine(m, "request_success_total", i, finished_reason="abort") for i in range(2))  # noqa
    for _ in range(3):
        before = wait_synced(http)
        with http.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert any(next(lines).startswith("data: ") for _ in range(6))
        after = wait_synced(http, finished(before) + 1)    # it ended, its blocks freed on its replica
        if aborts(after) == aborts(before) + 1:
            break
    else:
        raise AssertionError("three requests ran to their end after their client had left")
    gen = sum(engine(after, "generation_tokens_total", i) - engine(before, "generation_tokens_total", i)
              for i in range(2))
    assert gen < 400


def test_a_killed_replica_fails_its_requests_only_and_rejoins(http, client, server):
    body = {"prompt": PROMPT, "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
    for _ in range(3):      # a request that ended before the metrics showed it running is sent again
        before = wait_synced(http)
        with http.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            assert any(next(lines).startswith("data: ") for _ in range(6))
            m = wait_for(lambda: (m := metrics(http)) and (any(engine(m, "num_requests_running", i) for i in range(2))
                                                           or finished(m) > finished(before)) and m,
                         "the request to show in the metrics, or to end", timeout=WAIT_S, interval=0.05)
            running = [i for i in range(2) if engine(m, "num_requests_running", i)]
            if running:
                victim = running[0]
                ray.kill(replicas()[victim], no_restart=False)     # Ray restarts it
            events = sse_events(lines)
        if running:
            break
    else:
        raise AssertionError("three requests ended before the metrics showed them running")
    assert events[-1] == "[DONE]"
    assert "error" in events[-2] and f"replica {victim} died" in events[-2]["error"]["message"], events[-2:]
    # The other replica serves on; the server is healthy.
    assert httpx.get(server.url + "/health").status_code == 200
    for _ in range(3):
        out = client.completions.create(model="tiny", prompt="Keys and values", max_tokens=4, temperature=0)
        assert out.choices[0].finish_reason == "length"
    # The restarted replica rejoins (a fresh engine) and takes requests again.
    wait_for(lambda: engine(metrics(http), "router_replica_up", victim) == 1, "the replica to rejoin", timeout=240,
             interval=0.05)
    before = wait_synced(http)
    threads = [threading.Thread(target=client.completions.create,
                                kwargs=dict(model="tiny", prompt=p, max_tokens=24, temperature=0,
                                            extra_body={"ignore_eos": True}))
               for p in ("The quick brown fox", "An operating system maps pages")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    after = wait_synced(http, finished(before) + 2)
    done = [engine(after, "request_success_total", i, finished_reason="length")
            - engine(before, "request_success_total", i, finished_reason="length") for i in range(2)]
    assert done == [1, 1], done
