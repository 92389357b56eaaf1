"""Anthropic's Messages API over the chat serving: /v1/messages and /v1/messages/count_tokens.

A request becomes a chat request (ChatCompletionRequest) served by ChatServing: `system` (a
string or text blocks) the system message; `messages` (content a string or blocks: text,
tool_use in an assistant turn, tool_result in a user turn; images refused) the conversation, a
tool_use the assistant's tool call and a tool_result a tool message; `max_tokens`,
`stop_sequences`, `temperature`, `top_p`, `top_k`; `tools` ({name, description, input_schema})
the function tools and `tool_choice` theirs (auto -> "auto", which needs the server's
--enable-auto-tool-choice --tool-call-parser; any -> "required"; tool -> the named function;
none -> "none"; disable_parallel_tool_use). The answer is Anthropic's message (content blocks
text and tool_use, stop_reason end_turn | max_tokens | stop_sequence | tool_use, usage), or with
`stream` its events: message_start, then per block content_block_start, content_block_delta
(text_delta or input_json_delta) ..., content_block_stop, then message_delta (stop_reason, usage)
and message_stop. Errors are Anthropic's {"type": "error", "error": {"type", "message"}}; the API
key may come as x-api-key (the gate, app.py).
"""
from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from pagedserve.outputs import CompletionOutput, RequestOutput
from pagedserve.server.errors import APIError, bad_request, invalid_body, parse_body
from pagedserve.server.protocol import ChatCompletionRequest, Int, OpenAIModel
from pagedserve.server.serving import STREAM_ERRORS, ChatServing, chained, chat_prompt_ids
from pagedserve.server.state import ServerState
from pagedserve.server.tools import ToolStreamer, parse_tool_calls

logger = logging.getLogger(__name__)

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               503: "overloaded_error"}


def anthropic_error(e: APIError) -> JSONResponse:
    kind = ERROR_TYPES.get(e.status, "invalid_request_error" if e.status < 500 else "api_error")
    return JSONResponse({"type": "error", "error": {"type": kind, "message": e.message}}, status_code=e.status,
                        headers=e.headers)


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class MessagesRequest(OpenAIModel):
    model: str | None = None
    messages: list[dict[str, Any]]
    max_tokens: Int | None = None
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None


# ---- request -> chat ----------------------------------------------------------------------------
def _text(content: Any, where: str) -> str:
    """A string, or text blocks, as text (tool_result content)."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of content blocks", "messages")
    parts = []
    for block in content:
        if not isinstance(block, dict) or block.get("type") != "text":
            kind = block.get("type") if isinstance(block, dict) else None
            raise bad_request(f"{where}: only text blocks are supported here, got {kind!r}", "messages")
        parts.append(str(block.get("text", "")))
    return "\n".join(parts)


def chat_messages(system: str | list | None, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if system:
        out.append({"role": "system", "content": _text(system, "system")})
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant"):
            raise bad_request(f"{where}.role must be user or assistant, got {role!r}", "messages")
        content = m.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise bad_request(f"{where}.content must be a string or a list of content blocks", "messages")
        texts, calls = [], []
        for j, block in enumerate(content):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                texts.append(str(block.get("text", "")))
            elif kind == "tool_use" and role == "assistant":
                calls.append({"id": str(block.get("id", _id("toolu"))), "type": "function",
                              "function": {"name": block.get("name"), "arguments": json.dumps(block.get("input", {}))}})
            elif kind == "tool_result" and role == "user":
                text = _text(block.get("content"), f"{where}.content[{j}].content")
                if block.get("is_error"):
                    text = f"Error: {text}"
                out.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id", "")), "content": text})
            elif kind in ("thinking", "redacted_thinking"):
                continue
            elif kind in ("image", "document"):
                raise bad_request(f"{where}.content[{j}]: {kind} blocks are not supported (no vision models)",
                                  "messages")
            else:
                raise bad_request(f"{where}.content[{j}]: blocks of type {kind!r} are not supported (text, tool_use, "
                                  f"tool_result)", "messages")
        if texts or calls:
            message: dict[str, Any] = {"role": role, "content": "\n".join(texts)}
            if calls:
                message["tool_calls"] = calls
            out.append(message)
    return out


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or "input_schema" not in tool or tool.get("type") not in (None, "custom"):
            raise bad_request(f"tools[{i}]: only custom tools with name and input_schema are supported", "tools")
        fn = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        if tool.get("description"):
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: dict[str, Any] | None) -> str | dict | None:
    if choice is None:
        return None
    kind = choice.get("type")
    if kind == "auto":
        return "auto"
    if kind == "any":
        return "required"
    if kind == "none":
        return "none"
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise bad_request(f"tool_choice.type must be auto, any, tool or none; got {kind!r}", "tool_choice")


def chat_request(req: MessagesRequest) -> ChatCompletionRequest:
    chat = {"model": req.model, "messages": chat_messages(req.system, req.messages), "stream": req.stream,
            "max_tokens": req.max_tokens, "stop": req.stop_sequences, "temperature": req.temperature,
            "top_p": req.top_p, "top_k": req.top_k, "tools": chat_tools(req.tools),
            "tool_choice": chat_tool_choice(req.tool_choice)}
    if req.tool_choice and req.tool_choice.get("disable_parallel_tool_use"):
        chat["parallel_tool_calls"] = False
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in chat.items() if v is not None})
    except ValidationError as e:
        raise invalid_body(e) from None


# ---- serving ------------------------------------------------------------------------------------
class MessagesServing(ChatServing):
    prompt_param = "messages"

    def __init__(self, state: ServerState, req: MessagesRequest, raw: Request) -> None:
        if req.max_tokens is None:
            raise bad_request("max_tokens: Field required", "max_tokens")
        if req.max_tokens < 1:
            raise bad_request(f"max_tokens must be >= 1, got {req.max_tokens}", "max_tokens")
        self.req = req
        super().__init__(state, chat_request(req), raw)
        self.id = _id("msg")

    async def create(self) -> Response:
        self.top = None
        stream = await self.submit_chat(True, False, None, self.req.max_tokens, True)
        if self.req.stream:
            outputs = stream.__aiter__()
            first = await self.first_output(stream, outputs)
            return StreamingResponse(self._events(stream, chained(first, outputs)), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        (final,) = await self.final_outputs(stream)
        return JSONResponse(self.message(final))

    def _stop(self, c: CompletionOutput, called: bool) -> tuple[str, str | None]:
        if called:
            return "tool_use", None
        if c.finish_reason == "length":
            return "max_tokens", None
        if isinstance(c.stop_reason, str) and c.stop_reason in (self.req.stop_sequences or ()):
            return "stop_sequence", c.stop_reason
        return "end_turn", None

    def _shell(self, content: list, stop: tuple[str | None, str | None], usage: dict) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop[0], "stop_sequence": stop[1], "usage": usage}

    @staticmethod
    def _usage(final: RequestOutput | None, output_tokens: int) -> dict[str, Any]:
        """Anthropic's input_tokens leave out those read from the (prefix) cache: the prompt is their sum."""
        prompt = len(final.prompt_token_ids) if final is not None else 0
        cached = min(final.num_cached_tokens, prompt) if final is not None else 0
        return {"input_tokens": prompt - cached, "output_tokens": output_tokens, "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": cached}

    def message(self, final: RequestOutput) -> dict[str, Any]:
        c = final.outputs[0]
        content, calls = parse_tool_calls(self.tools, c.text) if self.tools is not None else (c.text, [])
        blocks: list[dict[str, Any]] = []
        if content or not calls:
            blocks.append({"type": "text", "text": content or ""})
        for call in calls:
            blocks.append({"type": "tool_use", "id": _id("toolu"), "name": call.function.name,
                           "input": _input(call.function.arguments)})
        return self._shell(blocks, self._stop(c, bool(calls)), self._usage(final, len(c.token_ids)))

    async def _events(self, stream, outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[str]:
        def event(kind: str, **data: Any) -> str:
            return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"

        watcher = asyncio.create_task(self._abort_on_disconnect(stream))
        streamer = ToolStreamer(self.tools) if self.tools is not None else None
        index = -1                  # the open block's index
        open_kind: str | None = None
        calls: dict[int, int] = {}  # the streamer's call index -> block index
        final, started, error = None, False, None
        try:
            async for out in outputs:
                self._check_aborted(out)
                final = out
                if not started:
                    started = True
                    yield event("message_start", message=self._shell([], (None, None), self._usage(out, 0)))
                for delta in self.deltas(0, out):
                    content, deltas = streamer.feed(delta.text, delta.finished) if streamer else (delta.text, [])
                    if content:
                        if open_kind != "text":
                            if open_kind is not None:
                                yield event("content_block_stop", index=index)
                            index, open_kind = index + 1, "text"
                            yield event("content_block_start", index=index, content_block={"type": "text", "text": ""})
                        yield event("content_block_delta", index=index, delta={"type": "text_delta", "text": content})
                    for call in deltas or []:
                        if call.index not in calls:
                            if open_kind is not None:
                                yield event("content_block_stop", index=index)
                            index, open_kind = index + 1, "tool_use"
                            calls[call.index] = index
                            yield event("content_block_start", index=index, content_block={
                                "type": "tool_use", "id": _id("toolu"), "name": call.function.name or "", "input": {}})
                        if call.function.arguments:
                            yield event("content_block_delta", index=calls[call.index],
                                        delta={"type": "input_json_delta", "partial_json": call.function.arguments})
            if open_kind is None:   # nothing generated: one empty text block
                index, open_kind = 0, "text"
                yield event("content_block_start", index=0, content_block={"type": "text", "text": ""})
            yield event("content_block_stop", index=index)
            c = final.outputs[0]
            stop_reason, stop_sequence = self._stop(c, bool(calls))
            yield event("message_delta", delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                        usage={"output_tokens": len(c.token_ids)})
            yield event("message_stop")
        except STREAM_ERRORS as e:
            failure = self.api_error(e)
            error = failure.message
            yield event("error", error={"type": ERROR_TYPES.get(failure.status, "api_error"), "message": error})
        finally:
            watcher.cancel()
            stream.close()
            self.log_finish([final] if final is not None else [], error)


def _input(arguments: str) -> Any:
    try:
        return json.loads(arguments) if arguments else {}
    except ValueError:
        return {}


class CountTokensRequest(OpenAIModel):
    model: str | None = None
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None


def add_anthropic_routes(app: FastAPI, state: ServerState) -> None:
    async def answer(work) -> Response:
        try:
            return await work()
        except APIError as e:
            state.log_refusal("POST", "/v1/messages", e)
            return anthropic_error(e)

    @app.post("/v1/messages")
    async def messages(raw: Request) -> Response:
        async def work():
            req = await parse_body(raw, MessagesRequest)
            return await MessagesServing(state, req, raw).create()
        return await answer(work)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(raw: Request) -> Response:
        async def work():
            req = await parse_body(raw, CountTokensRequest)
            state.check_model(req.model)
            body = chat_request(MessagesRequest(model=req.model, messages=req.messages, system=req.system,
                                                tools=req.tools, max_tokens=1))
            tools = body.tools
            ids = await state.prompts.render_chat(chat_prompt_ids, body.messages, True, False, None, tools,
                                                  tools=tools)
            return JSONResponse({"input_tokens": len(ids)})
        return await answer(work)
