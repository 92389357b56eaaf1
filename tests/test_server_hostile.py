"""Round three of the hostile-client catalogue (issue 34), on the real server (a subprocess on
the tiny model): structured outputs, tools and chat options. Every client mistake is a 400 in
OpenAI's shape naming the field, streamed or not; no 5xx, and no Python traceback in the server's
log. Slow compiles come from tests/fault_server.py's SLOW_COMPILE marker."""
from __future__ import annotations

import threading

import httpx
import pytest

from tests.fault_server import SLOW_COMPILE
from tests.server_utils import api_server_args, served, sse_events, wait_idle

COMPILE_TIMEOUT = 1.0
USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    server = served(tiny_llama.path, tmp_path_factory.mktemp("server"), api_server_args(
        "--structured-outputs-compile-timeout", str(COMPILE_TIMEOUT)), module="tests.fault_server")
    srv = next(server)
    yield srv
    next(server, None)    # stops it, cleanly
    assert "Traceback" not in srv.log() and "internal error" not in srv.log(), srv.log()[-5000:]


def chat(**kw) -> dict:
    return {"messages": USER, "max_tokens": 4, **kw}


def nested(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


NESTED_TEXT = '{"type": "array", "items": ' * 300 + '{"type": "integer"}' + "}" * 300
PYDANTIC_TOOL = {"type": "function", "function": {"name": "make_city", "parameters": {
    "$defs": {"Country": {"type": "object", "properties": {"code": {"enum": ["FR", "DE"]}}, "required": ["code"]}},
    "type": "object", "properties": {"country": {"$ref": "#/$defs/Country"}}, "required": ["country"]}}}

# (name, body, param of the 400)
CASES = [
    ("pattern-with-a-huge-bounded-repeat", chat(response_format={"type": "json_schema", "json_schema": {
        "name": "s", "schema": {"type": "string", "pattern": ".{1,4588}"}}}), "response_format"),
    ("regex-huge-repeat", chat(structured_outputs={"regex": "a{1,9000}"}), "structured_outputs"),
    ("arrays-nested-150-deep", chat(response_format={"type": "json_schema", "json_schema": {
        "name": "s", "schema": nested(150)}}), "response_format"),
    ("schema-string-nested-300-deep", chat(structured_outputs={"json": NESTED_TEXT}), "structured_outputs"),
    ("schema-string-nested-5000-deep", chat(guided_json="[" * 5000 + "]" * 5000), "guided_json"),
    ("unsatisfiable-grammar", chat(structured_outputs={"grammar": "root ::= root"}), "structured_outputs"),
    ("left-recursive-grammar", chat(guided_grammar='root ::= a\na ::= a "x"'), "guided_grammar"),
    ("compile-over-the-time-limit", chat(structured_outputs={"grammar": f'root ::= "{SLOW_COMPILE}"'}),
     "structured_outputs"),
    ("continue-final-with-add-generation-prompt", chat(continue_final_message=True, add_generation_prompt=True),
     "continue_final_message"),
    ("template-kwargs-messages", chat(chat_template_kwargs={"messages": []}), "chat_template_kwargs"),
    ("template-kwargs-tools", chat(chat_template_kwargs={"tools": 5}), "chat_template_kwargs"),
    ("tool-choice-function-is-a-string", chat(tools=[TOOL], tool_choice={"type": "function", "function": "get"}),
     "tool_choice"),
    ("tool-choice-function-is-a-list", chat(tools=[TOOL], tool_choice={"type": "function", "function": ["get"]}),
     "tool_choice"),
    ("tool-choice-function-is-a-number", chat(tools=[TOOL], tool_choice={"type": "function", "function": 5}),
     "tool_choice"),
    ("tool-choice-name-unhashable", chat(tools=[TOOL], tool_choice={"type": "function",
                                                                    "function": {"name": ["get"]}}), "tool_choice"),
    ("tool-choice-name-is-an-object", chat(tools=[TOOL], tool_choice={"type": "function",
                                                                      "function": {"name": {"a": 1}}}), "tool_choice"),
    ("tool-choice-wrong-type", chat(tools=[TOOL], tool_choice={"type": "tool", "function": {"name": "get"}}),
     "tool_choice"),
    ("tool-choice-a-number", chat(tools=[TOOL], tool_choice=5), "tool_choice"),
    ("tool-choice-unknown-string", chat(tools=[TOOL], tool_choice="always"), "tool_choice"),
    ("tools-element-a-string", chat(tools=["get"]), "tools"),
    ("tools-function-a-list", chat(tools=[{"type": "function", "function": []}], tool_choice="required"), "tools"),
    ("tool-parameters-a-string", chat(tools=[{"type": "function", "function": {"name": "a", "parameters": "x"}}],
                                      tool_choice="required"), "tools"),
    ("tool-parameters-bad-schema", chat(tools=[{"type": "function", "function": {
        "name": "a", "parameters": {"type": "nope"}}}], tool_choice="required"), "tools"),
    ("tool-defs-not-an-object", chat(tools=[{"type": "function", "function": {
        "name": "a", "parameters": {"$defs": 5}}}], tool_choice="required"), "tools"),
    ("message-tool-calls-odd-shape", {"messages": [{"role": "assistant", "tool_calls": [{"x": 1}]}, *USER],
                                      "max_tokens": 2, "chat_template_kwargs": {"strict": True}}, None),
]


def check_400(r: httpx.Response, param: str | None, name: str) -> None:
    assert r.status_code == 400, (name, r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    if param is not None:
        assert err["param"] == param, (name, err)


@pytest.mark.parametrize("name, body, param", [c for c in CASES if c[2] is not None], ids=[c[0] for c in CASES
                                                                                          if c[2] is not None])
@pytest.mark.parametrize("stream", [False, True])
def test_client_mistakes_get_a_400_naming_the_field(http, name, body, param, stream):
    r = http.post("/v1/chat/completions", json={**body, "stream": stream})
    check_400(r, param, name)


def test_odd_message_shapes_are_never_a_5xx(http):
    for name, body, param in CASES:
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code < 500, (name, r.text)


def test_a_slow_compile_of_a_queued_request_ends_it_with_a_clear_400(http):
    """Compiling takes place after the request is queued; when it runs past the time limit the
    client gets a 400 (not a 500, not an error event inside a 200 stream), and the others go on."""
    results = {}

    def slow(stream: bool):
        results[stream] = http.post("/v1/chat/completions", json=chat(
            stream=stream, structured_outputs={"grammar": f'root ::= "{SLOW_COMPILE}-{stream}"'}))
    threads = [threading.Thread(target=slow, args=(s,)) for s in (False, True)]
    for t in threads:
        t.start()
    r = http.post("/v1/chat/completions", json=chat(structured_outputs={"choice": ["yes", "no"]}))
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] in ("yes", "no"), r.text
    for t in threads:
        t.join(60)
    for stream, r in results.items():
        check_400(r, "structured_outputs", f"slow stream={stream}")
        assert "time limit" in r.json()["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_response_whose_schema_the_engine_refuses_gets_a_400_streamed_or_not(http, stream):
    """/v1/responses: a text.format schema refused once queued (too big to compile, past the
    time limit) is a 400 before any event, as on /v1/chat/completions."""
    for name, schema in (("huge-bounded-repeat", {"type": "string", "pattern": ".{1,4588}"}),
                         ("over-the-time-limit", {"const": f"{SLOW_COMPILE}-response-{stream}"})):
        r = http.post("/v1/responses", json={"model": "tiny", "input": "hi", "max_output_tokens": 4, "stream": stream,
                                             "text": {"format": {"type": "json_schema", "name": "s", "schema": schema}}})
        check_400(r, None, name)
    assert http.get("/health").status_code == 200


def test_required_tool_choice_resolves_defs_like_a_named_one(http):
    """pydantic puts nested models under $defs: "required" hoists each tool's $defs."""
    for choice in ("required", {"type": "function", "function": {"name": "make_city"}}):
        r = http.post("/v1/chat/completions", json=chat(tools=[PYDANTIC_TOOL], tool_choice=choice, max_tokens=40,
                                                          temperature=0))
        assert r.status_code == 200, r.text


def test_no_block_is_held_and_the_server_still_answers(server, http):
    m = wait_idle(http)
    assert m["pagedserve:kv_cache_usage_perc"] == 0
    r = http.post("/v1/chat/completions", json=chat(stream=True))
    events = sse_events(r.text.splitlines())
    assert r.status_code == 200 and events[-1] == "[DONE]"
    log = server.log()
    assert "Traceback" not in log and "internal error" not in log, log[-5000:]


# ---- chat: the cheap limits and the tokenizer lanes -------------------------------------------
def test_many_empty_messages_are_refused_before_the_template_renders_them(http):
    """Empty messages have no characters, but each renders the template's overhead of a message."""
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": ""}] * 100_000,
                                                "max_tokens": 1})
    check_400(r, "messages", "100k empty messages")
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and "100000 messages" in err["message"], err


def test_a_huge_render_does_not_hold_a_small_one(tiny_tokenizer):
    """The large lane renders on its own thread: a small chat is answered while a huge one renders."""
    import asyncio

    from pagedserve.server.prompts import PromptProcessor
    from pagedserve.server.protocol import ChatMessage
    release = threading.Event()

    def render(tokenizer, messages):
        if len(messages) > 300:
            release.wait(60)
        return tokenizer.encode("x" * len(messages))

    async def main():
        prompts = PromptProcessor(tiny_tokenizer, 4096, lambda n: None)
        huge = asyncio.ensure_future(prompts.render_chat(render, [ChatMessage(role="user", content="")] * 400))
        await asyncio.sleep(0)
        small = await asyncio.wait_for(prompts.render_chat(render, [ChatMessage(role="user", content="hi")]), 30)
        assert not huge.done()
        release.set()
        await huge
        prompts.close()
        return small
    assert asyncio.run(main())


# ---- tenants: the dashboard hides what salted requests hold ----------------------------------
SECRET = "Tenant alpha's secret plan: the zebra moves at dawn, and the fox keeps watch by the river. " * 3


def test_the_dashboard_hides_the_text_of_salted_blocks(http):
    r = http.post("/v1/completions", json={"prompt": SECRET, "max_tokens": 2, "cache_salt": "tenant-alpha"})
    assert r.status_code == 200, r.text
    public = "An operating system maps pages of virtual memory to physical frames. " * 3
    assert http.post("/v1/completions", json={"prompt": public, "max_tokens": 2}).status_code == 200
    snap = http.get("/v1/kv/snapshot")
    assert snap.status_code == 200
    texts = [b.get("text", "") for b in snap.json()["blocks"]]
    assert any("virtual memory" in t for t in texts)          # unsalted blocks keep their text
    assert not any(w in snap.text for w in ("zebra", "secret", "dawn", "Tenant")), "a salted prompt leaked"
    assert any(b.get("hidden") for b in snap.json()["blocks"])  # its blocks are marked, not shown


def test_a_grammar_that_never_ends_stops_at_max_tokens(http):
    """No terminating derivation: the request ends with a clear finish reason, not an error."""
    r = http.post("/v1/chat/completions", json=chat(guided_grammar='root ::= "a" root', max_tokens=5))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and set(choice["message"]["content"]) <= {"a"}
