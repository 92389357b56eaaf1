"""/v1/responses with the official openai client against a live server on the tiny model:
plain, streamed (the Responses event sequence), function tools (named, required, a tool
loop), text.format json_schema, the store (previous_response_id, GET, background and
cancel) and OpenAI-shaped errors. The text is checked against /v1/chat/completions on the
same conversation (greedy), which tests/test_server.py checks against the offline engine."""
from __future__ import annotations

import json
import time

import httpx
import jsonschema
import openai
import pytest

from tests.fault_server import SLOW_STEPS
from tests.server_utils import API_KEY

WEATHER = {"type": "function", "name": "get_weather", "description": "the weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                          "required": ["city"], "additionalProperties": False}}
TIME = {"type": "function", "name": "get_time", "parameters": {"type": "object", "properties": {}}}


@pytest.fixture(scope="module")
def server(api_server):
    return api_server


def chat_text(client, messages, max_tokens):
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=max_tokens, temperature=0,
                                       extra_body={"ignore_eos": True})
    return r.choices[0].message.content, r.usage


def test_plain_response_equals_chat(client):
    r = client.responses.create(model="tiny", input="Tell me a story", instructions="be brief",
                                max_output_tokens=12, temperature=0, extra_body={"ignore_eos": True}, store=False)
    text, usage = chat_text(client, [{"role": "system", "content": "be brief"},
                                     {"role": "user", "content": "Tell me a story"}], 12)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "tiny"
    assert r.output_text == text and r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert (r.usage.input_tokens, r.usage.output_tokens) == (usage.prompt_tokens, 12)
    assert r.usage.total_tokens == usage.prompt_tokens + 12 and r.store is False
    # Items as input: a message list gives the same prompt.
    r2 = client.responses.create(model="tiny", instructions="be brief", max_output_tokens=12, temperature=0,
                                 input=[{"role": "user", "content": [{"type": "input_text", "text": "Tell me a story"}]}],
                                 extra_body={"ignore_eos": True})
    assert r2.output_text == text


def test_streamed_response_events(client):
    # Slowed steps (tests/fault_server.py): the 10 tokens take at least 200 ms, so they cannot all be
    # ready at the first read; how many deltas a read takes depends on the reader's speed.
    kw = dict(model="tiny", input=f"Hello there {SLOW_STEPS}", max_output_tokens=10, temperature=0,
              extra_body={"ignore_eos": True})
    whole = client.responses.create(**kw)
    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) >= 2 and "".join(deltas) == whole.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = events[-1].response
    assert done.output_text == whole.output_text and done.usage.output_tokens == 10


def test_function_tools_named_required_and_a_tool_loop(client):
    named = client.responses.create(model="tiny", input="weather in Paris?", tools=[WEATHER, TIME],
                                    tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=40,
                                    temperature=0)
    (call,) = named.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    required = client.responses.create(model="tiny", input="weather?", tools=[WEATHER, TIME], tool_choice="required",
                                       parallel_tool_calls=False, max_output_tokens=200, temperature=0)
    calls = [o for o in required.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name in ("get_weather", "get_time"), required.output
    # The loop: the call and its output go back as items; the answer is free text (auto).
    loop = client.responses.create(model="tiny", tools=[WEATHER], max_output_tokens=5, temperature=0, input=[
        {"role": "user", "content": "weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert loop.status in ("completed", "incomplete") and loop.usage.input_tokens > named.usage.input_tokens
    none = client.responses.create(model="tiny", input="hi", tools=[WEATHER], tool_choice="none",
                                   max_output_tokens=4)
    assert all(o.type == "message" for o in none.output)


def test_streamed_function_call_events(client):
    events = list(client.responses.create(model="tiny", input="weather?", tools=[WEATHER], stream=True,
                                          tool_choice={"type": "function", "name": "get_weather"},
                                          max_output_tokens=40, temperature=0))
    kinds = [e.type for e in events]
    assert kinds[2] == "response.output_item.added" and events[2].item.type == "function_call"
    assert "response.function_call_arguments.delta" in kinds
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert done.arguments == args and done.name == "get_weather"
    jsonschema.validate(json.loads(args), WEATHER["parameters"])
    assert kinds[-2:] == ["response.output_item.done", "response.completed"]
    assert events[-1].response.output[0].arguments == args


def test_json_schema_text_format(client):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                               "adult": {"type": "boolean"}},
              "required": ["name", "adult"], "additionalProperties": False}
    r = client.responses.create(model="tiny", input="a person", max_output_tokens=100, temperature=0,
                                text={"format": {"type": "json_schema", "name": "person", "schema": schema}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)
    r = client.responses.create(model="tiny", input="a json", max_output_tokens=20, temperature=0,
                                text={"format": {"type": "json_object"}})
    assert r.output_text.startswith("{")     # an object, cut at 20 tokens (the random model's keys are long)


def test_store_previous_response_and_get(client, server):
    first = client.responses.create(model="tiny", input="My name is Ann", max_output_tokens=4, temperature=0,
                                    store=True)
    assert first.store is True and client.responses.retrieve(first.id).output_text == first.output_text
    second = client.responses.create(model="tiny", input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=4, temperature=0)
    # The same conversation sent whole gives the same answer.
    text, usage = chat_text(client, [{"role": "user", "content": "My name is Ann"},
                                     {"role": "assistant", "content": first.output_text},
                                     {"role": "user", "content": "What is my name?"}], 4)
    assert second.usage.input_tokens == usage.prompt_tokens and second.output_text == text
    unstored = client.responses.create(model="tiny", input="x", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny", input="x", previous_response_id="resp_nope")
    assert e.value.body["param"] == "previous_response_id"
    for _ in range(4):    # the store keeps 4: the first one is gone
        client.responses.create(model="tiny", input="x", max_output_tokens=1)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


def test_background_and_cancel(client, server):
    r = client.responses.create(model="tiny", input="go on", max_output_tokens=450, background=True,
                                extra_body={"ignore_eos": True})
    assert r.status == "in_progress"
    cancelled = client.responses.cancel(r.id)
    assert cancelled.status == "cancelled" and client.responses.retrieve(r.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(r.id)
    done = client.responses.create(model="tiny", input="hi", max_output_tokens=3, background=True)
    while done.status == "in_progress":
        done = client.responses.retrieve(done.id)
    assert done.status in ("completed", "incomplete") and done.usage.output_tokens <= 3


def test_errors_are_openai_shaped(client, server):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny", input="x", tools=[{"type": "web_search"}])
    assert e.value.body["param"] == "tools" and e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="tiny", input="x", max_output_tokens=5000)
    assert e.value.body["param"] == "max_output_tokens"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="other", input="x")
    r = httpx.post(server.url + "/v1/responses", headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"input": [{"type": "image", "url": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"


def test_metadata_is_limited_as_openai_limits_it(client):
    """16 pairs, keys of 64 characters, values of 512 strings (issue 51: 8 MiB of metadata per
    stored response was kept)."""
    for metadata in ({f"k{i}": "v" for i in range(17)}, {"k": "v" * 513}, {"k" * 65: "v"}, {"k": 5}):
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model="tiny", input="x", max_output_tokens=1, metadata=metadata)
        assert e.value.body["param"] == "metadata", metadata
    ok = client.responses.create(model="tiny", input="x", max_output_tokens=1,
                                 metadata={f"k{i}": "v" * 512 for i in range(16)})
    assert ok.metadata["k15"] == "v" * 512


def test_the_store_is_bounded_in_bytes():
    from pagedserve.server.responses import ResponseStore, StoredResponse
    store = ResponseStore(size=1000, max_bytes=100_000)
    for i in range(50):
        store.put(f"r{i}", StoredResponse({"output": "x" * 10_000}, [{"role": "user", "content": "y" * 5_000}]))
        assert store.total <= 100_000
    assert 5 <= len(store.entries) <= 6 and "r49" in store.entries and "r0" not in store.entries
    store.put("r49", StoredResponse({"output": ""}, []))          # counted anew when it changes
    assert store.total == sum(store.sizes.values()) < 100_000


def test_a_stored_stream_whose_client_leaves_does_not_stay_in_progress(client, server):
    """The client reads the first events and disconnects: the request is aborted and its stored
    response ends cancelled (issue 51: in_progress forever)."""
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as http:
        # Slowed steps: its 400 tokens take at least 8 s, so it is still running when the client leaves.
        with http.stream("POST", "/v1/responses", json={"model": "tiny", "input": f"go on {SLOW_STEPS}", "stream": True,
                                                        "store": True, "max_output_tokens": 400,
                                                        "ignore_eos": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and '"response.created"' in line:
                    rid = json.loads(line[6:])["response"]["id"]
                    break
    status = "in_progress"
    for _ in range(600):        # (60 s: returns once it changes)
        status = client.responses.retrieve(rid).status
        if status != "in_progress":
            break
        time.sleep(0.1)
    assert status == "cancelled"
