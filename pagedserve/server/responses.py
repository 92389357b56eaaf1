"""/v1/responses: OpenAI's Responses API (as vLLM serves it) over the chat machinery.

A request becomes a chat request: `instructions` the system message, `input` (a string, or
items: messages, `function_call` and `function_call_output`) the conversation after the one
`previous_response_id` names, `max_output_tokens` max_tokens, function `tools` and
`tool_choice` the chat tools (server/tools.py's constraint and parser), `text.format` the
response_format (structured outputs). It is served by ChatServing's engine calls and shaped
here: `output` items (a `message` with `output_text`, `function_call`s), usage, and when
streamed the Responses events (response.created, response.in_progress, then per item
output_item.added, content_part.added, output_text.delta ..., output_text.done,
content_part.done, output_item.done, or function_call_arguments.delta/.done for a call;
response.completed last).

The store (`--enable-responses-api-store`, as vLLM's VLLM_ENABLE_RESPONSES_API_STORE) keeps
responses created with `store: true`, at most `--responses-api-store-size`, the oldest
dropped first: `previous_response_id`, `GET /v1/responses/{id}`, `background: true` and
`POST /v1/responses/{id}/cancel` need it. Without it every response is `store: false`.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import logging
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError, field_validator

from pagedserve.chat_templates import warning_headers
from pagedserve.outputs import CompletionOutput, RequestOutput
from pagedserve.server.errors import APIError, bad_request, invalid_body, parse_body
from pagedserve.server.protocol import ChatCompletionRequest, Int, OpenAIModel
from pagedserve.server.serving import STREAM_ERRORS, ChatServing, _ignored_fields_logged, chained
from pagedserve.server.state import ServerState
from pagedserve.server.tools import ToolStreamer, parse_tool_calls

logger = logging.getLogger(__name__)


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesRequest(OpenAIModel):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: Int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    stream: bool = False
    store: bool = True                       # OpenAI's default; without the server's store, nothing is kept
    background: bool = False
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    seed: Int | None = None
    # vLLM's extra sampling parameters, as for chat
    top_k: Int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop: str | list[str] | None = None

    @field_validator("metadata")
    @classmethod
    def _metadata_as_openai(cls, metadata: dict[str, str] | None) -> dict[str, str] | None:
        """OpenAI's limits: at most 16 pairs, keys of 64 characters, values of 512 (a stored
        response keeps them: no client may park megabytes there)."""
        if metadata is not None:
            if len(metadata) > METADATA_PAIRS:
                raise ValueError(f"at most {METADATA_PAIRS} key-value pairs; got {len(metadata)}")
            for key, value in metadata.items():
                if len(key) > METADATA_KEY_CHARS or len(value) > METADATA_VALUE_CHARS:
                    raise ValueError(f"keys of at most {METADATA_KEY_CHARS} characters and values of at most "
                                     f"{METADATA_VALUE_CHARS}; {key[:64]!r} has {len(key)} and {len(value)}")
        return metadata


METADATA_PAIRS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512


# ---- the store ----------------------------------------------------------------------------------
@dataclass
class StoredResponse:
    response: dict[str, Any]
    conversation: list[dict[str, Any]]       # input messages (no instructions) + the output's, for the next turn
    serving: "ResponsesServing | None" = None   # while it runs: cancel aborts it
    cancelled: bool = False
    task: asyncio.Task | None = None         # a background response's


@dataclass
class ResponseStore:
    """The responses created with store=true, at most `size` of them and `max_bytes` of their
    JSON (response and conversation), the oldest dropped first. put() again when an entry
    changes (it is counted anew)."""
    size: int = 1000
    max_bytes: int = 64 * 1024**2
    entries: OrderedDict = field(default_factory=OrderedDict)
    sizes: dict = field(default_factory=dict)         # rid -> its bytes as last put
    total: int = 0

    def put(self, rid: str, entry: StoredResponse) -> None:
        self.total -= self.sizes.pop(rid, 0)
        self.sizes[rid] = len(json.dumps(entry.response, default=str)) + len(json.dumps(entry.conversation,
                                                                                         default=str))
        self.total += self.sizes[rid]
        self.entries[rid] = entry
        self.entries.move_to_end(rid)
        while self.entries and (len(self.entries) > max(self.size, 1) or self.total > self.max_bytes):
            old, _ = self.entries.popitem(last=False)
            self.total -= self.sizes.pop(old)

    def get(self, rid: str) -> StoredResponse | None:
        return self.entries.get(rid)


# ---- request -> chat ----------------------------------------------------------------------------
def _text_of(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of content parts", "input")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise bad_request(f"{where}: only text content parts are supported (input_text, output_text), got "
                              f"{kind!r}", "input")
        texts.append(str(part.get("text", "")))
    return "\n".join(texts)


def items_to_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses input (or output) items as chat messages: messages as they are, a run of
    function_call items as one assistant message with tool_calls, function_call_output as a tool
    message; reasoning items are dropped."""
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object", "input")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("system", "developer", "user", "assistant"):
                raise bad_request(f"{where}.role must be system, developer, user or assistant; got {role!r}", "input")
            messages.append({"role": role, "content": _text_of(item.get("content"), where)})
        elif kind == "function_call":
            if not isinstance(item.get("name"), str) or not isinstance(item.get("call_id"), str):
                raise bad_request(f"{where}: a function_call needs name and call_id", "input")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": str(item.get("arguments", ""))}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise bad_request(f"{where}: a function_call_output needs call_id", "input")
            output = item.get("output", "")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": output if isinstance(output, str) else _text_of(output, where)})
        elif kind == "reasoning":
            continue
        else:
            raise bad_request(f"{where}: items of type {kind!r} are not supported (message, function_call, "
                              f"function_call_output)", "input")
    return messages


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses function tools ({"type": "function", "name", "parameters", ...}) in the chat form."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise bad_request(f"tools[{i}]: only function tools are supported, got {kind!r}", "tools")
        fn = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: str | dict | None) -> str | dict | None:
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise bad_request(f'tool_choice must be "none", "auto", "required" or {{"type": "function", "name": '
                              f'NAME}}; got {choice!r}', "tool_choice")
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """text.format (text, json_object, json_schema with name and schema) as chat's response_format."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise bad_request("text.format json_schema needs a schema object", "text")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "schema"), "schema": fmt["schema"]}}
    raise bad_request(f"text.format.type must be text, json_object or json_schema; got {kind!r}", "text")


# ---- output items -------------------------------------------------------------------------------
def message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}] if status == "completed" \
        else []
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


class ResponsesServing(ChatServing):
    prompt_param = "input"
    renamed_params = {"max_tokens": "max_output_tokens", "logprobs": "top_logprobs"}

    def __init__(self, state: ServerState, req: ResponsesRequest, raw: Request,
                 store: ResponseStore | None) -> None:
        self.req = req
        self.store = store if req.store else None
        new_ignored = {f"responses.{k}" for k in req.model_extra or ()} - _ignored_fields_logged
        if new_ignored:    # e.g. include, reasoning, truncation: accepted, logged once each
            _ignored_fields_logged.update(new_ignored)
            logger.warning("ignoring /v1/responses field(s) pagedserve does not support: %s (logged once per field)",
                           ", ".join(sorted(new_ignored)))
        if req.background and self.store is None:
            raise bad_request("background needs store: true and the server's store (--enable-responses-api-store)",
                              "background")
        previous: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            if store is None:
                raise bad_request("previous_response_id needs the server's response store: start it with "
                                  "--enable-responses-api-store", "previous_response_id")
            entry = store.get(req.previous_response_id)
            if entry is None:
                raise bad_request(f"previous response with id {req.previous_response_id!r} not found",
                                  "previous_response_id")
            previous = entry.conversation
        given = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else items_to_messages(req.input)
        if not given and not previous:
            raise bad_request("input must not be empty", "input")
        self.conversation = previous + given
        system = [{"role": "system", "content": req.instructions}] if req.instructions else []
        chat = {"model": req.model, "messages": system + self.conversation, "stream": req.stream,
                "tools": chat_tools(req.tools), "tool_choice": chat_tool_choice(req.tool_choice),
                "parallel_tool_calls": req.parallel_tool_calls, "response_format": response_format(req.text)}
        for name in ("temperature", "top_p", "seed", "top_k", "min_p", "repetition_penalty", "user", "ignore_eos", "stop"):
            chat[name] = getattr(req, name)
        try:
            body = ChatCompletionRequest.model_validate({k: v for k, v in chat.items() if v is not None})
        except ValidationError as e:
            raise invalid_body(e) from None
        super().__init__(state, body, raw)
        self.id = _id("resp")

    # -- the engine request -----------------------------------------------------------------------
    async def start(self):
        """Render the conversation and submit it; returns the engine stream."""
        self.top = None
        explicit = self.req.max_output_tokens is not None
        requested = self.req.max_output_tokens if explicit else self.defaults.get("max_tokens")
        self.stream = await self.submit_chat(True, False, None, requested, explicit)
        return self.stream

    async def _abort_on_disconnect(self, stream) -> None:
        if not self.req.background:          # a background response outlives its HTTP request
            await super()._abort_on_disconnect(stream)

    async def create(self) -> JSONResponse | StreamingResponse:
        self._entry = None
        stream = await self.start()
        entry = None
        if self.store is not None:
            entry = StoredResponse(self.response_dict("in_progress", []), list(self.conversation), self)
            self.store.put(self.id, entry)
        self._entry = entry
        if self.req.background:
            entry.task = asyncio.create_task(self._run_in_background(stream))
            return JSONResponse(entry.response, headers=warning_headers(self.warning))
        if self.req.stream:
            outputs = stream.__aiter__()
            try:
                first = await self.first_output(stream, outputs)
            except APIError as e:
                self._finish_entry(None, e.message)
                raise
            return StreamingResponse(self._response_events(stream, chained(first, outputs)),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", **warning_headers(self.warning)})
        try:
            (final,) = await self.final_outputs(stream)
        except APIError:
            self._finish_entry(None)
            raise
        return JSONResponse(self._finish_entry(final), headers=warning_headers(self.warning))

    async def _run_in_background(self, stream) -> None:
        try:
            (final,) = await self.final_outputs(stream)
        except APIError as e:
            self._finish_entry(None, e.message)
            return
        self._finish_entry(final)

    def _finish_entry(self, final: RequestOutput | None, error: str | None = None) -> dict[str, Any]:
        """The finished response (also into the store, with its output for the next turn)."""
        entry = self._entry
        if final is None:
            cancelled = entry is not None and entry.cancelled
            response = self.response_dict("cancelled" if cancelled else "failed", [],
                                          error=None if cancelled else {"code": "server_error",
                                                                        "message": error or "the request failed"})
        else:
            status, incomplete = self._status(final)
            response = self.response_dict(status, self.output_items(final.outputs[0]), incomplete, final)
        return self._store(response)

    def _store(self, response: dict[str, Any]) -> dict[str, Any]:
        """The finished response into the store (with its output for the next turn), if stored."""
        if self._entry is not None:
            self._entry.response, self._entry.serving = response, None
            self._entry.conversation = self.conversation + items_to_messages(response["output"])
            self.store.put(self.id, self._entry)       # counted anew, with its output
        return response

    # -- shapes -----------------------------------------------------------------------------------
    @staticmethod
    def _status(final: RequestOutput) -> tuple[str, dict | None]:
        if final.outputs and final.outputs[0].finish_reason == "length":
            return "incomplete", {"reason": "max_output_tokens"}
        return "completed", None

    def output_items(self, c: CompletionOutput) -> list[dict[str, Any]]:
        content, calls = c.text, []
        if self.tools is not None:
            content, calls = parse_tool_calls(self.tools, c.text)
        items = []
        if content or not calls:
            items.append(message_item(_id("msg"), content or ""))
        items += [call_item(_id("fc"), _id("call"), call.function.name, call.function.arguments) for call in calls]
        return items

    def usage_dict(self, final: RequestOutput | None) -> dict[str, Any] | None:
        if final is None:
            return None
        usage = self.usage([final])
        return {"input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens,
                "total_tokens": usage.total_tokens,
                "input_tokens_details": {"cached_tokens": final.num_cached_tokens},
                "output_tokens_details": {"reasoning_tokens": 0}}

    def response_dict(self, status: str, output: list, incomplete: dict | None = None,
                      final: RequestOutput | None = None, error: dict | None = None) -> dict[str, Any]:
        r = self.req
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "model": self.model, "output": output, "usage": self.usage_dict(final), "error": error,
                "incomplete_details": incomplete, "instructions": r.instructions,
                "max_output_tokens": r.max_output_tokens, "temperature": r.temperature, "top_p": r.top_p,
                "tools": r.tools or [], "tool_choice": r.tool_choice or "auto",
                "parallel_tool_calls": r.parallel_tool_calls, "text": r.text or {"format": {"type": "text"}},
                "previous_response_id": r.previous_response_id, "store": self.store is not None,
                "background": r.background, "metadata": r.metadata or {}, "user": r.user, "truncation": "disabled",
                "reasoning": None}

    # -- streaming --------------------------------------------------------------------------------
    async def _response_events(self, stream, outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[str]:
        numbers = itertools.count()

        def event(kind: str, **data: Any) -> str:
            return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': next(numbers), **data})}\n\n"

        watcher = asyncio.create_task(self._abort_on_disconnect(stream))
        items: list[dict[str, Any]] = []        # the output so far, in order
        text: dict[int, str] = {}               # open message's output index -> its text
        calls: dict[int, int] = {}              # the streamer's call index -> output index
        open_index: int | None = None
        streamer = ToolStreamer(self.tools) if self.tools is not None else None
        final = None

        def close(index: int | None) -> list[str]:
            if index is None:
                return []
            item, out = items[index], []
            if item["type"] == "message":
                part = {"type": "output_text", "text": text[index], "annotations": [], "logprobs": []}
                ids = dict(item_id=item["id"], output_index=index, content_index=0)
                out.append(event("response.output_text.done", **ids, text=text[index], logprobs=[]))
                out.append(event("response.content_part.done", **ids, part=part))
                item.update(status="completed", content=[part])
            else:
                out.append(event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                 name=item["name"], arguments=item["arguments"]))
                item["status"] = "completed"
            out.append(event("response.output_item.done", output_index=index, item=item))
            return out

        yield event("response.created", response=self.response_dict("in_progress", []))
        yield event("response.in_progress", response=self.response_dict("in_progress", []))
        try:
            async for out in outputs:
                self._check_aborted(out)
                self.prompt_tokens[0] = len(out.prompt_token_ids)
                final = out
                for delta in self.deltas(0, out):
                    content, deltas = streamer.feed(delta.text, delta.finished) if streamer else (delta.text, [])
                    if content:
                        if open_index is None or items[open_index]["type"] != "message":
                            for line in close(open_index):
                                yield line
                            open_index = len(items)
                            items.append(message_item(_id("msg"), "", "in_progress"))
                            text[open_index] = ""
                            yield event("response.output_item.added", output_index=open_index,
                                        item=items[open_index])
                            yield event("response.content_part.added", item_id=items[open_index]["id"],
                                        output_index=open_index, content_index=0,
                                        part={"type": "output_text", "text": "", "annotations": []})
                        text[open_index] += content
                        yield event("response.output_text.delta", item_id=items[open_index]["id"],
                                    output_index=open_index, content_index=0, delta=content, logprobs=[])
                    for call in deltas or []:
                        if call.index not in calls:
                            for line in close(open_index):
                                yield line
                            open_index = calls[call.index] = len(items)
                            items.append(call_item(_id("fc"), _id("call"), call.function.name or "", "",
                                                   "in_progress"))
                            yield event("response.output_item.added", output_index=open_index,
                                        item=dict(items[open_index]))
                        index = calls[call.index]
                        if call.function.arguments:
                            items[index]["arguments"] += call.function.arguments
                            yield event("response.function_call_arguments.delta", item_id=items[index]["id"],
                                        output_index=index, delta=call.function.arguments)
            for line in close(open_index):
                yield line
            if not items:    # nothing generated: still one (empty) message
                items.append(message_item(_id("msg"), ""))
            status, incomplete = self._status(final)
            response = self._store(self.response_dict(status, items, incomplete, final))
            kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
            yield event(kind, response=response)
        except STREAM_ERRORS as error:
            e = self.api_error(error)
            response = self._finish_entry(None, e.message)
            yield event("response.failed" if response["status"] == "failed" else "response.cancelled",
                        response=response)
            yield event("error", code=e.code or "server_error", message=e.message, param=e.param)
        finally:
            watcher.cancel()
            stream.close()
            if self._entry is not None and self._entry.response.get("status") == "in_progress":
                self._entry.cancelled = True      # the client left mid-stream: its request was aborted
                self._finish_entry(None)
            self.log_finish([final] if final is not None else [])


# ---- routes -------------------------------------------------------------------------------------
def add_responses_routes(app: FastAPI, state: ServerState) -> None:
    options = state.options
    store = ResponseStore(options.responses_api_store_size, options.responses_api_store_bytes) \
        if options.enable_responses_api_store else None

    def stored(response_id: str) -> StoredResponse:
        entry = store.get(response_id) if store is not None else None
        if entry is None:
            why = "" if store is not None else " (this server keeps none: --enable-responses-api-store)"
            raise APIError(404, f"no stored response with id {response_id!r}{why}", "response_id")
        return entry

    @app.post("/v1/responses")
    async def create_response(raw: Request):
        body = await parse_body(raw, ResponsesRequest, state.prompts.precheck_responses_body)
        return await ResponsesServing(state, body, raw, store).create()

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str) -> JSONResponse:
        return JSONResponse(stored(response_id).response)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str) -> JSONResponse:
        entry = stored(response_id)
        if entry.serving is None:
            raise bad_request(f"response {response_id!r} is {entry.response['status']}: only a response still in "
                              f"progress can be cancelled", "response_id")
        entry.cancelled = True
        entry.serving.stream.abort()
        if entry.task is not None:
            await asyncio.shield(entry.task)
        else:
            entry.response = dict(entry.response, status="cancelled")
        return JSONResponse(entry.response)
