"""LoRA adapters on the server (a real subprocess on the tiny model): --lora-modules in both
forms, /v1/models with parents, the openai client choosing adapters by name (tokens equal
peft's), unknown names 404, runtime load/unload behind the API key (also while a request
of the adapter streams), bad adapters 400, and vLLM's lora_requests_info gauge."""
from __future__ import annotations

import json
import shutil

import httpx
import openai
import pytest

from tests.lora_utils import make_adapter, oracle_greedy
from tests.server_utils import api_server_args, metrics, served

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("server_loras")
    prompt = tiny_llama.tokenizer.encode("The quick brown fox")
    want = {"tiny": oracle_greedy(tiny_llama.hf, prompt, MAX_TOKENS)}
    for seed, (name, rank) in enumerate((("sql", 8), ("chat", 4), ("third", 2), ("too_big", 16))):
        model = make_adapter(tiny_llama.hf, root / name, seed + 20, rank=rank, alpha=rank)
        want[name] = oracle_greedy(model, prompt, MAX_TOKENS)
    return root, prompt, want


@pytest.fixture(scope="module")
def server(tiny_llama, adapters, tmp_path_factory):
    root = adapters[0]
    chat = json.dumps({"name": "chat", "path": str(root / "chat"), "base_model_name": "tiny"})
    yield from served(tiny_llama.path, tmp_path_factory.mktemp("lora_server"), api_server_args(
        "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8", "--return-tokens-as-token-ids",
        "--lora-modules", f"sql={root / 'sql'}", chat), env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "true"})


def tokens(client, model, prompt):
    out = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                    logprobs=0, extra_body={"ignore_eos": True})
    assert out.model == model
    return [int(t.split(":")[1]) for t in out.choices[0].logprobs.tokens]


def test_adapters_by_name_equal_peft(client, adapters):
    _, prompt, want = adapters
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"tiny", "sql", "chat"}
    assert cards["sql"].parent == "tiny" and cards["chat"].parent == "tiny" and cards["tiny"].parent is None
    for model in ("sql", "chat", "tiny", "sql"):
        assert tokens(client, model, prompt) == want[model], model
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        tokens(client, "nope", prompt)
    chat = client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert chat.model == "chat"


def test_runtime_load_and_unload(server, client, http, adapters):
    root, prompt, want = adapters
    assert httpx.post(server.url + "/v1/load_lora_adapter",
                      json={"lora_name": "third", "lora_path": str(root / "third")}).status_code == 401
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "third", "lora_path": str(root / "third")})
    assert r.status_code == 200, r.text
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "third", "lora_path": "x"}).status_code == 400
    bad = http.post("/v1/load_lora_adapter", json={"lora_name": "big", "lora_path": str(root / "too_big")})
    assert bad.status_code == 400 and "max_lora_rank=8" in bad.json()["error"]["message"]
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "gone", "lora_path": str(root / "nowhere")}
                     ).status_code == 400
    assert tokens(client, "third", prompt) == want["third"]
    # Unloaded while one of its requests streams: that request finishes with it.
    stream = client.completions.create(model="third", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                       stream=True, logprobs=0,
                                       extra_body={"ignore_eos": True})
    got = []
    for i, chunk in enumerate(stream):
        if i == 0:
            assert http.post("/v1/unload_lora_adapter", json={"lora_name": "third"}).status_code == 200
        got += [int(t.split(":")[1]) for t in chunk.choices[0].logprobs.tokens]
    assert got == want["third"]
    with pytest.raises(openai.NotFoundError):
        tokens(client, "third", prompt)
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "third"}).status_code == 404
    assert "third" not in {m.id for m in client.models.list().data}
    assert tokens(client, "sql", prompt) == want["sql"]


def test_lora_requests_info_gauge(client, http, adapters):
    tokens(client, "sql", adapters[1])
    m = metrics(http)
    info = [k for k in m if k.startswith("pagedserve:lora_requests_info")]
    assert len(info) == 1 and 'max_lora="2"' in info[0] and "running_lora_adapters=" in info[0]
    assert m['pagedserve:lora_requests_total{lora_name="sql"}'] >= 2


def test_runtime_routes_need_the_switch_and_modules_parse(monkeypatch):
    from fastapi import FastAPI

    from pagedserve.server.lora import RUNTIME_UPDATES_ENV, ServerLoRAs, add_lora_routes, parse_lora_module

    class State:
        loras = ServerLoRAs(["a=/x", '{"name": "b", "path": "/y", "base_model_name": "m"}'])
    assert [(r.lora_name, r.lora_int_id, r.lora_path, r.base_model_name) for r in State.loras.adapters.values()] == \
        [("a", 1, "/x", None), ("b", 2, "/y", "m")]
    for bad in ("a", "=x", '{"name": "a"}', "{not json"):
        with pytest.raises(ValueError, match="--lora-modules"):
            parse_lora_module(bad)
    for value, routes in (("", False), ("0", False), ("false", False), ("true", True), ("1", True)):
        monkeypatch.setenv(RUNTIME_UPDATES_ENV, value)
        app = FastAPI()
        add_lora_routes(app, State())
        paths = {r.path for r in app.routes}
        assert ("/v1/load_lora_adapter" in paths and "/v1/unload_lora_adapter" in paths) == routes, value


def test_load_refuses_empty_mistyped_and_log_forging_values(server, http, adapters, tmp_path):
    """400s with a clear message, never a 500; a name cannot write a line of its own into the log."""
    root = adapters[0]
    for body, param in (({"lora_name": "", "lora_path": str(root / "sql")}, "lora_name"),
                        ({"lora_name": "x", "lora_path": ""}, "lora_path"),
                        ({"lora_name": "evil\nERROR forged line", "lora_path": str(root / "sql")}, "lora_name")):
        r = http.post("/v1/load_lora_adapter", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    for config in ([1], None, {"r": 4, "lora_alpha": "x"}, {"r": 4, "target_modules": [5]}):
        bad = tmp_path / f"bad{len(list(tmp_path.iterdir()))}"
        shutil.copytree(root / "sql", bad)
        (bad / "adapter_config.json").write_text(json.dumps(config))
        r = http.post("/v1/load_lora_adapter", json={"lora_name": bad.name, "lora_path": str(bad)})
        assert r.status_code == 400 and "LoRA adapter" in r.json()["error"]["message"], (config, r.text)
    assert not any(line.startswith("ERROR forged") for line in server.log().splitlines())
