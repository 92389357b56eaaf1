"""Several models behind one server (server/models_manager.py, server/multi.py) and the Ollama and
Anthropic APIs (server/ollama.py, server/anthropic.py), through their real clients.

One server for the module: a --models-dir holding the default model (SmolLM2 GGUF), the tiny
llama twice (`tiny`; `embed`, a pooling model by its settings), a third copy (`tiny2`) and a
broken .gguf, at most two loaded at once."""
from __future__ import annotations

import json
import math
import threading
import time

import httpx
import numpy as np
import pytest

from pagedserve.server.model_specs import find_models, parse_duration
from tests.server_utils import API_KEY, authed_http, openai_client, served

GREEDY = {"temperature": 0}
QUESTION = "What is 2+2?"


@pytest.fixture(scope="module")
def models_dir(tiny_llama, tmp_path_factory):
    from pagedserve.models.loader import default_model_path
    try:
        default = default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    d = tmp_path_factory.mktemp("models")
    (d / "smollm2.gguf").symlink_to(default)
    (d / "hermes.gguf").symlink_to(default)     # the same model with the hermes template (ChatML with tools)
    for name in ("tiny", "embed", "tiny2"):
        (d / name).symlink_to(tiny_llama.path)
    (d / "broken.gguf").write_bytes(b"GGUF" + bytes(60))
    tiny = {"dtype": "float32", "kv_cache_memory": 1 << 20}
    (d / "models.json").write_text(json.dumps({"smollm2": {"kv_cache_memory": 32 << 20}, "tiny": tiny,
                                               "hermes": {"kv_cache_memory": 32 << 20, "chat_template": "hermes"},
                                               "tiny2": tiny, "embed": {**tiny, "runner": "pooling"}}))
    return d


@pytest.fixture(scope="module")
def server(models_dir, tmp_path_factory):
    yield from served(None, tmp_path_factory.mktemp("multimodel"), [
        "--models-dir", str(models_dir), "--max-loaded-models", "2", "--api-key", API_KEY, "--shutdown-timeout", "0",
        "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--disable-uvicorn-access-log"])


@pytest.fixture(scope="module")
def http(server):
    with authed_http(server) as c:
        yield c


def statuses(http) -> dict[str, str]:
    return {m["id"]: m["status"]["value"] for m in http.get("/v1/models").json()["data"]}


def wait_status(http, name: str, want: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while statuses(http)[name] != want:
        assert time.monotonic() < deadline, f"{name} is {statuses(http)[name]}, not {want}"
        time.sleep(0.05)


def ollama_client(server):
    import ollama
    return ollama.Client(host=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120)


def anthropic_client(server):
    import anthropic
    return anthropic.Anthropic(base_url=server.url, api_key=API_KEY, max_retries=0, timeout=120)


# ---- without a server ---------------------------------------------------------------------------
def test_keep_alive_durations():
    assert parse_duration("5m") == 300 and parse_duration("1h30m") == 5400 and parse_duration(10) == 10
    assert parse_duration("0") == 0 and parse_duration(0) == 0 and parse_duration("250ms") == 0.25
    assert parse_duration(-1) == math.inf and parse_duration("-1m") == math.inf
    with pytest.raises(ValueError, match="keep_alive"):
        parse_duration("soon")


def test_models_dir_settings_are_checked(tmp_path, tiny_llama):
    (tmp_path / "a").symlink_to(tiny_llama.path)
    (tmp_path / "b.gguf").write_bytes(b"")
    (tmp_path / "notes").mkdir()                       # no config.json: not a model
    (tmp_path / "a.json").write_text(json.dumps({"dtype": "float32", "keep_alive": "1m"}))
    specs = {s.name: s for s in find_models(str(tmp_path), ["c=/x/y"])}
    assert set(specs) == {"a", "b", "c"} and specs["a"].settings == {"dtype": "float32"}
    assert specs["a"].server == {"keep_alive": "1m"} and specs["c"].path == "/x/y"
    (tmp_path / "a.json").write_text(json.dumps({"dtipe": "float32"}))
    with pytest.raises(ValueError, match="dtipe"):
        find_models(str(tmp_path), [])
    (tmp_path / "a.json").unlink()
    (tmp_path / "models.json").write_text(json.dumps({"zzz": {}}))
    with pytest.raises(ValueError, match="zzz"):
        find_models(str(tmp_path), [])
    with pytest.raises(ValueError, match="two models"):
        find_models(None, ["a=/x", "a=/y"])


# ---- the server ---------------------------------------------------------------------------------
def test_models_are_listed_and_loaded_on_first_request(server, http):
    assert set(statuses(http)) == {"smollm2", "hermes", "tiny", "embed", "tiny2", "broken"}
    http.post("/models/unload", json={"model": "smollm2"}).raise_for_status()
    assert statuses(http)["smollm2"] == "unloaded"
    reply = openai_client(server).chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": QUESTION}], max_tokens=16, **GREEDY)
    assert reply.model == "smollm2" and reply.choices[0].message.content
    assert statuses(http)["smollm2"] == "loaded"
    assert "loading model smollm2" in server.log() and "model smollm2 loaded in" in server.log()


def test_the_apis_give_the_same_greedy_answer(server):
    """OpenAI, Ollama and Anthropic clients reach the same model with the same template."""
    openai_text = openai_client(server).chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": QUESTION}], max_tokens=16, **GREEDY
    ).choices[0].message.content
    o = ollama_client(server)
    chat = o.chat(model="smollm2", messages=[{"role": "user", "content": QUESTION}],
                  options={"temperature": 0, "num_predict": 16})
    assert chat.message.content == openai_text and chat.done and chat.eval_count > 0 and chat.prompt_eval_count > 0
    streamed = list(o.chat(model="smollm2:latest", messages=[{"role": "user", "content": QUESTION}],
                           options={"temperature": 0, "num_predict": 16}, stream=True))
    assert "".join(p.message.content for p in streamed) == openai_text
    assert streamed[-1].done and streamed[-1].done_reason in ("stop", "length") and not streamed[0].done
    a = anthropic_client(server)
    message = a.messages.create(model="smollm2", max_tokens=16, messages=[{"role": "user", "content": QUESTION}],
                                extra_body=GREEDY)
    assert message.content[0].text == openai_text and message.stop_reason in ("end_turn", "max_tokens")
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == chat.prompt_eval_count
    count = a.messages.count_tokens(model="smollm2", messages=[{"role": "user", "content": QUESTION}])
    assert count.input_tokens == chat.prompt_eval_count
    with a.messages.stream(model="smollm2", max_tokens=16, messages=[{"role": "user", "content": QUESTION}],
                           extra_body=GREEDY) as stream:
        kinds = [event.type for event in stream]
        assert stream.get_final_text() == openai_text
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    assert kinds.index("content_block_start") < kinds.index("content_block_delta") < kinds.index("content_block_stop")


def test_ollama_generate_format_and_errors(server):
    import ollama
    o = ollama_client(server)
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    chat = o.chat(model="smollm2", messages=[{"role": "user", "content": "2+2 as JSON"}], format=schema,
                  options={"temperature": 0, "num_predict": 30})
    assert isinstance(json.loads(chat.message.content)["answer"], int)
    gen = o.generate(model="smollm2", prompt="The capital of France is", options={"temperature": 0, "num_predict": 6})
    assert gen.response and gen.context and len(gen.context) == gen.prompt_eval_count + gen.eval_count
    streamed = list(o.generate(model="smollm2", prompt="The capital of France is", stream=True,
                               options={"temperature": 0, "num_predict": 6}))
    assert "".join(p.response for p in streamed) == gen.response and streamed[-1].context == gen.context
    raw = o.generate(model="smollm2", prompt="The capital of France is", raw=True,
                     options={"temperature": 0, "num_predict": 6, "stop": ["\n"]})
    assert raw.prompt_eval_count < gen.prompt_eval_count    # no chat template around it
    # Tools: a conversation with a call and its result renders and is answered.
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                               "parameters": {"type": "object", "properties": {
                                                   "city": {"type": "string"}}, "required": ["city"]}}}]
    answer = o.chat(model="smollm2", tools=tools, options={"temperature": 0, "num_predict": 8}, messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_weather",
                                                                          "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny, 21 C", "tool_name": "get_weather"}])
    assert answer.done and answer.prompt_eval_count > chat.prompt_eval_count
    with pytest.raises(ollama.ResponseError, match="images") as e:
        o.chat(model="smollm2", messages=[{"role": "user", "content": "what is it?", "images": [b"\x89PNG"]}])
    assert e.value.status_code == 400
    with pytest.raises(ollama.ResponseError, match="not supported: models are files") as e:
        o.pull("llama3")
    with pytest.raises(ollama.ResponseError, match="does not exist"):
        o.chat(model="nope", messages=[{"role": "user", "content": "hi"}])
    assert {m.model for m in o.list().models} == {"smollm2", "hermes", "tiny", "embed", "tiny2", "broken"}
    assert "completion" in o.show("smollm2").capabilities


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CITIES = ["London", "Berlin", "Rome"]     # earlier turns: the small model follows them and calls the tool


def test_the_models_own_tool_calls_become_tool_calls(server):
    """No forced tool choice: the model writes a hermes <tool_call> and the server hands it out as
    Ollama's message.tool_calls (plain and streamed) and Anthropic's tool_use block."""
    def ask(city):
        return {"role": "user", "content": f"What is the weather in {city}?"}
    messages = []
    for city in CITIES:
        messages += [ask(city), {"role": "assistant", "content": "", "tool_calls": [
            {"function": {"name": "get_weather", "arguments": {"city": city}}}]}]
    messages.append(ask("Paris"))
    o = ollama_client(server)
    options = {"temperature": 0, "num_predict": 40}
    reply = o.chat(model="hermes", messages=messages, tools=[WEATHER], options=options)
    (call,) = reply.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == {"city": "Paris"}
    assert reply.message.content == "" and reply.done_reason == "stop"
    untouched = o.chat(model="hermes", messages=messages, options=options)    # no tools: the text as it is
    assert untouched.message.tool_calls is None and "<tool_call>" in untouched.message.content
    streamed = list(o.chat(model="hermes", messages=messages, tools=[WEATHER], options=options, stream=True))
    assert "".join(p.message.content for p in streamed) == "" and streamed[-1].done
    assert [c.function for p in streamed for c in p.message.tool_calls or []] == [call.function]

    a = anthropic_client(server)
    history = []
    for i, city in enumerate(CITIES):
        history += [ask(city), {"role": "assistant", "content": [
            {"type": "tool_use", "id": f"toolu_{i}", "name": "get_weather", "input": {"city": city}}]}]
    tool = {"name": "get_weather", "description": WEATHER["function"]["description"],
            "input_schema": WEATHER["function"]["parameters"]}
    message = a.messages.create(model="hermes", max_tokens=40, tools=[tool], messages=history + [ask("Paris")],
                                extra_body=GREEDY)
    assert message.stop_reason == "tool_use" and [b.type for b in message.content] == ["tool_use"]
    assert message.content[0].name == "get_weather" and message.content[0].input == {"city": "Paris"}


def test_anthropic_tools_and_errors(server):
    import anthropic
    a = anthropic_client(server)
    tool = {"name": "get_weather", "description": "the weather in a city",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
    first = a.messages.create(model="smollm2", max_tokens=40, tools=[tool], extra_body=GREEDY,
                              tool_choice={"type": "tool", "name": "get_weather"},
                              messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    (use,) = first.content
    assert first.stop_reason == "tool_use" and use.type == "tool_use" and use.name == "get_weather"
    assert isinstance(use.input["city"], str) and use.id.startswith("toolu_")
    with a.messages.stream(model="smollm2", max_tokens=40, tools=[tool], extra_body=GREEDY,
                           tool_choice={"type": "tool", "name": "get_weather"},
                           messages=[{"role": "user", "content": "What is the weather in Paris?"}]) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert streamed.content[0].type == "tool_use" and streamed.content[0].input == use.input
    assert streamed.stop_reason == "tool_use" and "input_json" in kinds
    second = a.messages.create(model="smollm2", max_tokens=12, tools=[tool], extra_body=GREEDY,
                               tool_choice={"type": "none"}, stop_sequences=["\n"], system="Be brief.", messages=[
                                   {"role": "user", "content": "What is the weather in Paris?"},
                                   {"role": "assistant", "content": first.model_dump()["content"]},
                                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                                 "content": "sunny, 21 C"}]}])
    assert second.content[0].type == "text" and second.stop_reason in ("end_turn", "max_tokens", "stop_sequence")
    with pytest.raises(anthropic.NotFoundError, match="does not exist"):
        a.messages.create(model="nope", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(anthropic.BadRequestError, match="image"):
        a.messages.create(model="smollm2", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBO"}}]}])
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model="smollm2", max_tokens=4, messages=[{"role": "user", "content": "hi"}])


def test_embeddings_keep_alive_and_lru(server, http):
    import ollama
    o = ollama_client(server)
    for name in ("tiny", "tiny2", "embed"):
        http.post("/models/unload", json={"model": name}).raise_for_status()
    http.post("/models/load", json={"model": "smollm2"}).raise_for_status()
    vectors = o.embed(model="embed", input=["hello world", "the sea"]).embeddings
    reference = openai_client(server).embeddings.create(model="embed", input="hello world", encoding_format="float")
    assert len(vectors) == 2 and vectors[0] == pytest.approx(reference.data[0].embedding, rel=1e-5, abs=1e-6)
    # Two are loaded (smollm2 used before embed): a third unloads the least recently used, smollm2.
    assert statuses(http)["smollm2"] == "loaded" and statuses(http)["embed"] == "loaded"
    assert o.generate(model="tiny", prompt="hi", options={"num_predict": 2}).load_duration > 0
    s = statuses(http)
    assert s["smollm2"] == "unloaded" and s["embed"] == "loaded" and s["tiny"] == "loaded", s
    assert "unloading model smollm2 (least recently used" in server.log()
    assert {m.model for m in o.ps().models} == {"embed", "tiny"}
    # keep_alive 0: unloaded once the request is answered; -1: kept (no expiry soon).
    o.generate(model="tiny", prompt="hi", options={"num_predict": 2}, keep_alive=0)
    wait_status(http, "tiny", "unloaded")
    o.generate(model="tiny", prompt="hi", options={"num_predict": 2}, keep_alive=-1)
    (entry,) = [m for m in o.ps().models if m.model == "tiny"]
    assert entry.expires_at.year > time.gmtime().tm_year + 5
    # Any route's body may carry it (taken off before the route sees it).
    openai_client(server).completions.create(model="tiny", prompt="hi", max_tokens=2, extra_body={"keep_alive": "0s"})
    wait_status(http, "tiny", "unloaded")
    assert "ignoring request field(s) pagedserve does not support: keep_alive" not in server.log()
    # An empty generate with keep_alive 0 unloads without generating (Ollama's way).
    o.generate(model="tiny", prompt="hi", options={"num_predict": 2})
    assert o.generate(model="tiny", keep_alive=0).done_reason == "unload"
    assert statuses(http)["tiny"] == "unloaded"
    metrics = http.get("/metrics").text
    assert 'pagedserve:model_loaded{model_name="embed"} 1.0' in metrics
    assert 'pagedserve:prompt_tokens_total{model_name="embed"}' in metrics
    with pytest.raises(ollama.ResponseError, match="pooling"):     # a generating model has no embeddings
        o.embed(model="tiny2", input="x")


def test_rerank_and_score_by_cosine(server, http):
    documents = ["the sea is blue", "a cat sat on the mat", "waves on the ocean"]
    vectors = [d.embedding for d in openai_client(server).embeddings.create(
        model="embed", input=["the ocean", *documents], encoding_format="float").data]
    cosines = [float(np.dot(vectors[0], v) / np.linalg.norm(vectors[0]) / np.linalg.norm(v)) for v in vectors[1:]]
    order = sorted(range(3), key=lambda i: -cosines[i])
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        r = http.post(path, json={"model": "embed", "query": "the ocean", "documents": documents, "top_n": 2}).json()
        assert [x["index"] for x in r["results"]] == order[:2], r
        assert [x["relevance_score"] for x in r["results"]] == pytest.approx([cosines[i] for i in order[:2]], abs=1e-5)
        assert r["results"][0]["document"]["text"] == documents[order[0]] and r["usage"]["total_tokens"] > 0
    score = http.post("/score", json={"model": "embed", "text_1": "the ocean", "text_2": documents}).json()
    assert [d["score"] for d in score["data"]] == pytest.approx(cosines, abs=1e-5)
    pairwise = http.post("/score", json={"model": "embed", "text_1": ["the ocean", "the ocean"],
                                         "text_2": documents[:2]}).json()
    assert [d["score"] for d in pairwise["data"]] == pytest.approx(cosines[:2], abs=1e-5)
    bad = http.post("/score", json={"model": "embed", "text_1": ["a", "b"], "text_2": documents})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "text_1"
    assert http.post("/v1/rerank", json={"model": "tiny2", "query": "q", "documents": ["d"]}).status_code == 400
    tokens = http.post("/tokenize", json={"model": "embed", "prompt": "the ocean"}).json()["tokens"]
    assert http.post("/detokenize", json={"model": "embed", "tokens": tokens}).json()["prompt"] == "the ocean"


def test_requests_wait_through_an_unload_and_reload(server, http):
    client = openai_client(server)
    http.post("/models/load", json={"model": "tiny2"}).raise_for_status()
    loads = server.log().count("model tiny2 loaded in")
    errors, done, stop = [], [], threading.Event()

    def ask(i: int) -> None:
        try:
            while not stop.is_set():
                r = client.completions.create(model="tiny2", prompt=f"request {i}", max_tokens=48,
                                              extra_body={"min_tokens": 48}, **GREEDY)
                done.append(r.choices[0].text)
        except Exception as e:   # noqa: BLE001 - every failure is the test's
            errors.append(e)
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    try:
        for _ in range(2):       # unload twice while requests are in flight and others arrive
            before = len(done)
            while len(done) < before + 3 and not errors:
                time.sleep(0.01)
            http.post("/models/unload", json={"model": "tiny2"}).raise_for_status()
        before = len(done)
        while len(done) < before + 3 and not errors:
            time.sleep(0.01)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors and len(done) >= 9
    assert server.log().count("model tiny2 loaded in") == loads + 2


def test_a_model_that_fails_to_load_leaves_the_others_serving(server, http):
    import openai
    client = openai_client(server)
    with pytest.raises(openai.InternalServerError, match="the model 'broken' failed to load"):
        client.chat.completions.create(model="broken", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    (card,) = [m for m in http.get("/v1/models").json()["data"] if m["id"] == "broken"]
    assert card["status"]["value"] == "failed" and "GGUF" in card["status"]["error"]
    r = client.completions.create(model="tiny2", prompt="still here", max_tokens=3)
    assert r.choices[0].text is not None
    assert http.post("/models/load", json={"model": "nope"}).status_code == 404
    # The dashboard of a model: its page's requests name no model and go where the page's URL says.
    http.post("/models/unload", json={"model": "tiny"}).raise_for_status()
    snapshot = http.get("/v1/kv/snapshot", headers={"Referer": f"{server.url}/dashboard?model=tiny"})
    assert snapshot.status_code == 200 and statuses(http)["tiny"] == "loaded"


def test_one_model_server_speaks_ollama_and_anthropic(api_server):
    """The one-model server has the same routes (and takes Anthropic's x-api-key)."""
    import anthropic
    o = ollama_client(api_server)
    assert [m.model for m in o.list().models] == ["tiny"]
    reply = o.chat(model="tiny", messages=[{"role": "user", "content": "hi"}], options={"num_predict": 3})
    assert reply.done and reply.eval_count <= 3
    a = anthropic_client(api_server)
    message = a.messages.create(model="tiny", max_tokens=3, messages=[{"role": "user", "content": "hi"}])
    assert message.usage.output_tokens <= 3 and message.role == "assistant"
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=api_server.url, api_key="wrong", max_retries=0).messages.create(
            model="tiny", max_tokens=3, messages=[{"role": "user", "content": "hi"}])


# ---- the manager alone (no engines: a stand-in start) -------------------------------------------
class _FakeLLM:
    max_model_len = 64

    def __init__(self, kv_offload_path: str | None = None) -> None:
        from pagedserve.config import EngineConfig
        self.config = EngineConfig(kv_offload_path=kv_offload_path)
        self.stopped = False
        self.shutdown_timeout: float | None = None

    async def shutdown(self, timeout: float = 30.0) -> None:
        self.stopped, self.shutdown_timeout = True, timeout

    def abort_all(self) -> None:
        pass


def _manager(names, **server):
    import asyncio

    from pagedserve.config import EngineConfig
    from pagedserve.server.config import ServerConfig
    from pagedserve.server.model_specs import ModelSpec
    from pagedserve.server.models_manager import LoadedModel, ModelManager
    from pagedserve.server.state import ServerState

    async def start(entry):
        await asyncio.sleep(0.01)
        if entry.name == "bad":
            raise ValueError("no such weights")
        llm = _FakeLLM(kv_offload_path="/tmp/tier" if entry.name.startswith("tier") else None)
        return LoadedModel(llm, ServerState(llm, [entry.name], None), None, 0)
    specs = [ModelSpec(n, f"/models/{n}", {"kv_cache_memory": 1 << 20}) for n in names]
    return ModelManager(specs, EngineConfig(), ServerConfig(**server), start)


def test_a_capacity_refusal_is_a_503_with_retry_after_and_leaves_the_model_unloaded():
    """Every loaded model busy: a request for another one gets a 503 with Retry-After in its API's
    shape, /v1/models shows it unloaded (not failed), and once a model is free the retry loads it."""
    import asyncio

    from starlette.responses import PlainTextResponse

    from pagedserve.server.config import ServerConfig
    from pagedserve.server.multi import ModelDispatch, build_top_app
    from pagedserve.server.state import ServerState

    async def scenario():
        m = _manager(["a", "b", "c"], max_loaded_models=2, keep_alive="-1")
        start = m._start_model

        async def start_with_routes(entry):
            loaded = await start(entry)
            loaded.app = PlainTextResponse(f"hello from {entry.name}")
            return loaded
        m._start_model = start_with_routes
        state = ServerState(m, list(m.entries), None)
        app = ModelDispatch(build_top_app(state, m, ServerConfig()), m)
        a, b = await m.acquire("a"), await m.acquire("b")                      # both busy
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            for path, body, shape in [
                    ("/v1/chat/completions", {"model": "c", "messages": []}, lambda j: j["error"]["code"]),
                    ("/api/chat", {"model": "c", "messages": [{"role": "user", "content": "hi"}]},
                     lambda j: j["error"]),
                    ("/v1/messages", {"model": "c", "max_tokens": 1, "messages": []}, lambda j: j["error"]["type"]),
                    ("/models/load", {"model": "c"}, lambda j: j["error"]["code"])]:
                r = await http.post(path, json=body)
                assert r.status_code == 503 and r.headers["retry-after"] == "1", (path, r.text)
                assert shape(r.json()) and "no loaded model is idle" in r.text, (path, r.text)
                cards = {c["id"]: c["status"] for c in (await http.get("/v1/models")).json()["data"]}
                assert cards["c"] == {"value": "unloaded"}, cards
            m.release(b)                                                          # b idle: it makes room
            r = await http.post("/v1/completions", json={"model": "c", "prompt": "hi"})
            assert r.status_code == 200 and r.text == "hello from c"
            cards = {c["id"]: c["status"]["value"] for c in (await http.get("/v1/models")).json()["data"]}
            assert cards == {"a": "loaded", "b": "unloaded", "c": "loaded"}
        m.release(a)
    asyncio.run(scenario())


def test_manager_least_recently_used_busy_and_memory():
    import asyncio

    from pagedserve.server.errors import APIError
    from pagedserve.server.model_specs import rss_bytes

    async def scenario():
        m = _manager(["a", "b", "c", "bad"], max_loaded_models=2, keep_alive="-1")
        a = await m.acquire("a")
        b = await m.acquire("b")
        m.release(b)
        c = await m.acquire("c")                                               # a is busy, b idle: b goes
        assert m.entries["b"].status == "unloaded" and m.entries["c"].status == "loaded"
        with pytest.raises(APIError, match="no loaded model is idle") as e:   # a and c busy
            await m.acquire("b")
        assert e.value.status == 503 and e.value.headers == {"Retry-After": "1"}
        assert m.entries["b"].status == "unloaded" and m.entries["b"].error is None   # not the model's fault
        assert m.entries["a"].status == "loaded" and m.entries["c"].status == "loaded"
        m.release(a)
        m.release(c)
        with pytest.raises(APIError, match="failed to load: ValueError: no such weights") as e:
            await m.acquire("bad")
        assert e.value.status == 500 and m.entries["bad"].error == "ValueError: no such weights"
        assert sum(e.status == "loaded" for e in m.entries.values()) == 1      # one was unloaded to try
        # Requests that arrive while a model unloads wait for it and load it again.
        a = await m.acquire("a")
        loads = a.loads
        unload = asyncio.ensure_future(m.unload("a"))
        await asyncio.sleep(0.02)
        assert m.entries["a"].status == "unloading"                            # waits for the request
        waiter = asyncio.ensure_future(m.acquire("a"))
        await asyncio.sleep(0.02)
        assert not waiter.done()
        m.release(a)
        await unload
        again = await waiter
        assert again.status == "loaded" and again.loads == loads + 1
        m.release(again, 0)                                                    # keep_alive 0: unloads at once
        for _ in range(3000):                  # (its gc.collect runs on a thread: seconds on a loaded machine)
            await asyncio.sleep(0.01)
            if again.status == "unloaded":
                break
        assert again.status == "unloaded"
        # --max-memory below what the process already uses: nothing to unload, so a 503.
        small = _manager(["a"], max_memory=str(rss_bytes() // 2))
        with pytest.raises(APIError, match="--max-memory") as e:
            await small.acquire("a")
        assert e.value.status == 503
    asyncio.run(scenario())


def test_an_engine_saving_to_the_disk_tier_gets_the_time_to_finish_at_unload_and_exit():
    """A model with a disk tier saves its pool's cached blocks on its engine's way out: its unload and
    the server's exit wait for that (found: 30 s and 5 s, and the exit dropped the blocks not yet written)."""
    import asyncio

    from pagedserve.server.state import TIER_SAVE_TIMEOUT_S

    async def scenario():
        m = _manager(["a", "tier-a", "tier-b"], keep_alive="-1")
        loaded = {name: await m.acquire(name) for name in m.entries}
        for entry in loaded.values():
            m.release(entry)
        a, tier_a = loaded["a"].loaded.llm, loaded["tier-a"].loaded.llm
        await m.unload("a")
        await m.unload("tier-a")
        assert (a.shutdown_timeout, tier_a.shutdown_timeout) == (30.0, TIER_SAVE_TIMEOUT_S)
        tier_b = loaded["tier-b"].loaded.llm
        await m.shutdown(timeout=5.0)
        assert tier_b.shutdown_timeout == TIER_SAVE_TIMEOUT_S
    asyncio.run(scenario())
