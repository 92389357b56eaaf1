"""Structured outputs and tool calling through the server, with the default model at temperature
1.0 (seeded; n=20 gives 20 samples in one call), and the hermes tool-call parser on its own."""
import json

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from pagedserve.models.loader import default_model_path
from pagedserve.server.errors import APIError
from pagedserve.server.protocol import ChatCompletionRequest
from pagedserve.server.tools import ToolPlan, ToolStreamer, parse_tool_calls, plan_tools
from tests.server_utils import served, sse_events
from tests.test_structured import PERSON, valid_json

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
WEATHER = {"type": "object",
           "properties": {"city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["celsius", "fahrenheit"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "unit", "days"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    try:
        default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    yield from served(None, tmp_path_factory.mktemp("server"), ["--enable-auto-tool-choice", "--tool-call-parser",
                                                                 "hermes", "--disable-uvicorn-access-log",
                                                                 "--log-stats-interval", "0"])


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_json_schema_response_format_20_samples(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe a person as JSON."}], n=20, temperature=1.0,
        seed=0, max_tokens=120,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    assert len(r.choices) == 20
    for c in r.choices:
        assert valid_json(c.message.content, PERSON), c.message.content


def test_openai_client_parse_returns_the_object(client):
    class City(BaseModel):
        name: str = Field(max_length=16)
        country: str = Field(max_length=16)
        population: int

    r = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Tell me about Paris."}],
                                      response_format=City, temperature=1.0, seed=0, max_tokens=150)
    assert isinstance(r.choices[0].message.parsed, City)


def test_structured_outputs_and_guided_fields_on_completions(client):
    r = client.completions.create(model=MODEL, prompt="Phone number:", n=20, max_tokens=16, temperature=1.0, seed=0,
                                  extra_body={"structured_outputs": {"regex": r"\(0[1-9]\) [0-9]{2}-[0-9]{2}"}})
    import re
    assert all(re.fullmatch(r"\(0[1-9]\) [0-9]{2}-[0-9]{2}", c.text) for c in r.choices), [c.text for c in r.choices]
    r = client.completions.create(model=MODEL, prompt="Is the sky green?", n=20, max_tokens=8, temperature=1.0,
                                  seed=0, extra_body={"guided_choice": ["yes", "no", "unsure"]})
    assert all(c.text in ("yes", "no", "unsure") for c in r.choices)
    r = client.chat.completions.create(model=MODEL, messages=ASK, n=4, max_tokens=60, temperature=1.0, seed=0,
                                       extra_body={"guided_json": WEATHER})
    assert all(valid_json(c.message.content, WEATHER) for c in r.choices)


def test_streamed_structured_output_parses(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A person as JSON."}], temperature=1.0, seed=3,
        max_tokens=120, stream=True, response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}})
    chunks = list(stream)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    # Streamed, not at once (how many pieces: as fast as the client reads; a slow read takes all since the last)
    assert len(chunks) >= 2 and valid_json(text, PERSON), text


def test_named_and_required_tool_choice(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, n=10, temperature=1.0, seed=0,
                                       max_tokens=60, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    for c in r.choices:
        (call,) = c.message.tool_calls
        assert call.function.name == "get_weather" and c.finish_reason == "tool_calls"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, n=10, temperature=1.0, seed=0,
                                       max_tokens=80, tool_choice="required", parallel_tool_calls=False)
    for c in r.choices:
        assert len(c.message.tool_calls) == 1 and c.finish_reason == "tool_calls"
        for call in c.message.tool_calls:
            params = WEATHER if call.function.name == "get_weather" else TOOLS[1]["function"]["parameters"]
            jsonschema.validate(json.loads(call.function.arguments), params)


def test_streamed_tool_calls(client):
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, temperature=1.0, seed=2,
                                            max_tokens=60, stream=True,
                                            tool_choice={"type": "function", "function": {"name": "get_weather"}})
    deltas = [(ch.choices[0].delta.tool_calls, ch.choices[0].finish_reason) for ch in stream if ch.choices]
    calls = [tc for d, _ in deltas for tc in d or []]
    # The arguments as they come: more than one delta (how many depends on how fast the client reads)
    assert calls[0].id and calls[0].function.name == "get_weather" and len(calls) >= 2
    jsonschema.validate(json.loads("".join(tc.function.arguments or "" for tc in calls)), WEATHER)
    assert deltas[-1][1] == "tool_calls"


def test_bad_constraints_and_tools_get_a_400_naming_the_field(server):
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
         "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"structured_outputs": {"regex": "(a"}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"shape": "round"}}, "structured_outputs"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_grammar": "root ::= "}, "guided_grammar"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
        ({"tools": [{"type": "retrieval"}], "tool_choice": "required"}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
        ({"response_format": {"type": "json_object"}, "use_beam_search": True}, "use_beam_search"),
    ]
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for extra, param in cases:
            r = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **extra})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (extra, r.text)
        r = http.post("/v1/completions", json={"prompt": "x", "guided_regex": "[", "max_tokens": 4})
        assert r.status_code == 400 and r.json()["error"]["param"] == "guided_regex"
        r = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, "stream": True,
                                                    "guided_choice": ["a", "b"]})
        events = sse_events(r.iter_lines())
        assert events[-1] == "[DONE]" and "".join(e["choices"][0]["delta"].get("content") or ""
                                                  for e in events[:-1] if e["choices"]) in ("a", "b")
        assert http.get("/health").status_code == 200


def test_auto_tool_choice_needs_the_server_flags():
    body = ChatCompletionRequest(messages=ASK, tools=TOOLS)
    with pytest.raises(APIError) as e:
        plan_tools(body, False, None)
    assert e.value.param == "tool_choice"
    assert plan_tools(body, True, "hermes").mode == "auto"
    assert plan_tools(ChatCompletionRequest(messages=ASK, tools=TOOLS, tool_choice="none"), False, None).mode == "none"


def test_hermes_parser_whole_and_streamed():
    plan = ToolPlan("auto", TOOLS)
    text = ('Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius", '
            '"days": 3}}</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>')
    content, calls = parse_tool_calls(plan, text)
    assert content == "Let me check."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius", "days": 3}), ("get_time", {"zone": "CET"})]
    assert parse_tool_calls(plan, "no calls <tool_call>{broken") == ("no calls <tool_call>{broken", [])
    for size in (1, 3, 7, 1000):   # any split of the text into deltas gives the same calls and content
        streamer, content, streamed = ToolStreamer(plan), "", []
        pieces = [text[i:i + size] for i in range(0, len(text), size)]
        for i, piece in enumerate(pieces):
            c, deltas = streamer.feed(piece, i == len(pieces) - 1)
            content += c or ""
            streamed += deltas
        assert content.strip() == "Let me check."
        assert [(d.index, d.function.name, d.function.arguments) for d in streamed] == \
            [(i, c.function.name, c.function.arguments) for i, c in enumerate(calls)]
    assert ToolStreamer(plan).feed("plain text <tool", True) == ("plain text <tool", [])
