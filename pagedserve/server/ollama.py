"""Ollama's API over the chat and embedding serving: /api/chat, /api/generate (NDJSON streams, the
default, or one JSON object with "stream": false), /api/embed and the older /api/embeddings,
/api/show; on a one-model server also /api/tags, /api/ps and /api/version (a multi-model server
answers those for the set: server/multi.py). Models are files: /api/pull, /api/push, /api/create,
/api/copy and /api/delete answer 501 saying so.

A request becomes a chat request (ChatCompletionRequest) served by ChatServing: `options`
(num_predict -> max_tokens, temperature, top_p, top_k, min_p, seed, stop, repeat_penalty,
presence_penalty, frequency_penalty; num_ctx is accepted, the model's context applies),
`format` ("json" or a JSON schema: structured output), `tools` (the chat tools; Ollama lets the
model choose, which needs --enable-auto-tool-choice --tool-call-parser), tool calls and tool
results in `messages`. `images` are refused (no vision models). Errors are Ollama's shape:
{"error": "..."} with the status; an error in a stream is its last line.
"""
from __future__ import annotations

import asyncio
import datetime
import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

import pagedserve
from pagedserve.outputs import CompletionOutput, RequestOutput
from pagedserve.server.embeddings import EmbeddingRequest, EmbeddingServing
from pagedserve.server.errors import APIError, bad_request, invalid_body, parse_body
from pagedserve.server.protocol import ChatCompletionRequest, OpenAIModel
from pagedserve.server.serving import STREAM_ERRORS, ChatServing, chained, chat_prompt_ids, check_max_tokens, \
    make_params
from pagedserve.server.state import ServerState
from pagedserve.server.tools import ToolStreamer, parse_tool_calls

logger = logging.getLogger(__name__)

NOT_SUPPORTED_PATHS = ("/api/pull", "/api/push", "/api/create", "/api/copy", "/api/delete")
# Ollama's options -> the chat request's sampling fields.
OPTION_FIELDS = {"num_predict": "max_tokens", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                 "min_p": "min_p", "seed": "seed", "stop": "stop", "repeat_penalty": "repetition_penalty",
                 "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty"}
# Options of llama.cpp's runner that mean nothing here: accepted, ignored.
IGNORED_OPTIONS = {"num_ctx", "num_batch", "num_gpu", "main_gpu", "low_vram", "numa", "num_thread", "num_keep",
                   "use_mmap", "use_mlock", "vocab_only", "logits_all", "embedding_only", "repeat_last_n",
                   "typical_p", "tfs_z", "mirostat", "mirostat_tau", "mirostat_eta", "penalize_newline", "f16_kv"}


def ollama_time(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc).isoformat().replace("+00:00", "Z")


def ollama_error(e: APIError) -> JSONResponse:
    return JSONResponse({"error": e.message}, status_code=e.status, headers=e.headers)


async def not_supported(raw: Request) -> JSONResponse:
    return JSONResponse({"error": f"{raw.url.path} is not supported: models are files in --models-dir (or given "
                                  f"with --model NAME=PATH); pagedserve pulls, pushes and deletes nothing"},
                        status_code=501)


def model_details(path: str, config: Any) -> dict[str, Any]:
    fmt = "gguf" if str(path).endswith(".gguf") else "safetensors"
    return {"parent_model": "", "format": fmt, "family": "", "families": None, "parameter_size": "",
            "quantization_level": (getattr(config, "quantization", None) or "") if fmt != "gguf" else "gguf"}


def ollama_model(name: str, path: str, size: int, config: Any) -> dict[str, Any]:
    """An /api/tags or /api/ps entry."""
    try:
        import os
        modified = os.stat(path).st_mtime
    except OSError:
        modified = time.time()
    return {"name": name, "model": name, "modified_at": ollama_time(modified), "size": size,
            "digest": hashlib.sha256(f"{name}:{path}".encode()).hexdigest(), "details": model_details(path, config)}


# ---- requests -----------------------------------------------------------------------------------
class OllamaRequest(OpenAIModel):
    model: str | None = None
    stream: bool = True
    options: dict[str, Any] | None = None
    format: str | dict[str, Any] | None = None
    keep_alive: float | str | None = None      # the dispatcher's (server/multi.py)
    think: bool | str | None = None


class ChatRequest(OllamaRequest):
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None


class GenerateRequest(OllamaRequest):
    prompt: str | None = None
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool = False
    images: list[Any] | None = None


class EmbedRequest(OpenAIModel):
    model: str | None = None
    input: str | list[str] | None = None
    prompt: str | None = None                  # /api/embeddings (the older route)
    truncate: bool = True
    options: dict[str, Any] | None = None
    keep_alive: float | str | None = None
    dimensions: int | None = None


def _sampling(options: dict[str, Any] | None) -> dict[str, Any]:
    out = {}
    for key, value in (options or {}).items():
        if key in OPTION_FIELDS:
            out[OPTION_FIELDS[key]] = value
        elif key not in IGNORED_OPTIONS:
            raise bad_request(f"options.{key} is not supported (supported: {', '.join(sorted(OPTION_FIELDS))})",
                              "options")
    if out.get("max_tokens") is not None and out["max_tokens"] < 0:   # Ollama: -1 is "no limit"
        out["max_tokens"] = None
    return out


def _response_format(fmt: str | dict | None) -> dict | None:
    if fmt in (None, ""):
        return None
    if fmt == "json":
        return {"type": "json_object"}
    if isinstance(fmt, dict):
        return {"type": "json_schema", "json_schema": {"name": "format", "schema": fmt}}
    raise bad_request(f'format must be "json" or a JSON schema object, got {fmt!r}', "format")


def _chat_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ollama's messages as chat messages: images refused, tool calls' arguments (objects) as JSON
    text, a tool result's tool_name kept as its name."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad_request(f"messages[{i}] must be an object", "messages")
        if m.get("images"):
            raise bad_request(f"messages[{i}].images: images are not supported (no vision models)", "images")
        message = {"role": m.get("role"), "content": m.get("content") or ""}
        if m.get("tool_calls"):
            message["tool_calls"] = [
                {"id": f"call_{i}_{j}", "type": "function",
                 "function": {"name": (c.get("function") or {}).get("name"),
                              "arguments": json.dumps((c.get("function") or {}).get("arguments") or {})}}
                for j, c in enumerate(m["tool_calls"])]
        if m.get("role") == "tool" and m.get("tool_name"):
            message["name"] = m["tool_name"]
        out.append(message)
    return out


def _validated(chat: dict[str, Any]) -> ChatCompletionRequest:
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in chat.items() if v is not None})
    except ValidationError as e:
        raise invalid_body(e) from None


def _arguments(text: str) -> Any:
    try:
        return json.loads(text) if text else {}
    except ValueError:
        return text


class OllamaServing(ChatServing):
    """One /api/chat or /api/generate request."""
    prompt_param = "messages"
    renamed_params = {"max_tokens": "options.num_predict", "logprobs": "logprobs"}

    def __init__(self, state: ServerState, req: ChatRequest | GenerateRequest, raw: Request) -> None:
        self.req = req
        self.is_chat = isinstance(req, ChatRequest)
        chat: dict[str, Any] = {"model": _served_name(state, req.model), "stream": req.stream, "response_format": _response_format(req.format)}
        chat.update(_sampling(req.options))
        self.requested = chat.pop("max_tokens", None)
        if self.is_chat:
            chat["messages"] = _chat_messages(req.messages or [])
            chat["tools"] = req.tools or None
        else:
            if req.images:
                raise bad_request("images are not supported (no vision models)", "images")
            if req.template:
                raise bad_request("template is not supported: the model's chat template applies (or raw: true)",
                                  "template")
            if req.suffix:
                raise bad_request("suffix is not supported", "suffix")
            system = [{"role": "system", "content": req.system}] if req.system else []
            chat["messages"] = system + [{"role": "user", "content": req.prompt or ""}]
            self.prompt_param = "prompt"
        super().__init__(state, _validated(chat), raw)

    async def create(self) -> Response:
        explicit = self.requested is not None
        requested = self.requested if explicit else self.defaults.get("max_tokens")
        self.top = None
        if self.is_chat:
            stream = await self.submit_chat(True, False, None, requested, explicit)
        else:
            stream = await self._submit_generate(requested, explicit)
        if self.req.stream:
            outputs = stream.__aiter__()
            first = await self.first_output(stream, outputs)
            return StreamingResponse(self._lines(stream, chained(first, outputs)), media_type="application/x-ndjson")
        (final,) = await self.final_outputs(stream)
        c = final.outputs[0]
        body = self._final_fields(final)
        if self.is_chat:
            content, calls = (parse_tool_calls(self.tools, c.text) if self.tools is not None else (c.text, []))
            message: dict[str, Any] = {"role": "assistant", "content": content or ""}
            if calls:
                message["tool_calls"] = [{"function": {"name": call.function.name,
                                                       "arguments": _arguments(call.function.arguments)}}
                                         for call in calls]
            body["message"] = message
        else:
            body["response"] = c.text
            body["context"] = list(final.prompt_token_ids) + list(c.token_ids)
        return JSONResponse(body)

    async def _submit_generate(self, requested: int | None, explicit: bool):
        self.tools = None
        structured = await self.constraint()
        req = self.req
        if req.raw:
            (ids,) = await self.state.prompts.encode([req.prompt or ""])
        else:
            ids = await self.state.prompts.render_chat(chat_prompt_ids, self.body.messages, True)
        ids = list(req.context or []) + ids
        check_max_tokens(requested, explicit, len(ids), self.llm.max_model_len)
        params = make_params(self.body, requested, None, structured=structured, defaults=self.defaults)
        return await self.submit([(None, ids, params)])

    def _head(self) -> dict[str, Any]:
        return {"model": self.model, "created_at": ollama_time(time.time())}

    def _final_fields(self, final: RequestOutput | None, completion_tokens: int | None = None) -> dict[str, Any]:
        c: CompletionOutput | None = final.outputs[0] if final is not None and final.outputs else None
        reason = {"length": "length"}.get(c.finish_reason, "stop") if c is not None else "stop"
        now = time.monotonic()
        m = final.metrics if final is not None else None
        first = m.first_token_time if m is not None and m.first_token_time else now
        prompt_ns = int(max(first - self.arrival, 0) * 1e9)
        return {**self._head(), "done": True, "done_reason": reason, "total_duration": int((now - self.arrival) * 1e9) + _load_ns(self.raw),
                "load_duration": _load_ns(self.raw),
                "prompt_eval_count": len(final.prompt_token_ids) if final is not None else 0,
                "prompt_eval_duration": prompt_ns,
                "eval_count": len(c.token_ids) if c is not None else (completion_tokens or 0),
                "eval_duration": int(max(now - first, 0) * 1e9)}

    async def _lines(self, stream, outputs: AsyncIterator[RequestOutput]) -> AsyncIterator[str]:
        watcher = asyncio.create_task(self._abort_on_disconnect(stream))
        streamer = ToolStreamer(self.tools) if self.tools is not None else None
        calls: dict[int, list[str]] = {}           # call index -> [name, arguments so far]
        final, error = None, None
        try:
            async for out in outputs:
                self._check_aborted(out)
                final = out
                for delta in self.deltas(0, out):
                    content, deltas = streamer.feed(delta.text, delta.finished) if streamer else (delta.text, [])
                    for call in deltas or []:
                        entry = calls.setdefault(call.index, ["", ""])
                        entry[0] = entry[0] or call.function.name or ""
                        entry[1] += call.function.arguments or ""
                    if content:
                        piece = {"message": {"role": "assistant", "content": content}} if self.is_chat \
                            else {"response": content}
                        yield json.dumps({**self._head(), **piece, "done": False}) + "\n"
            last = self._final_fields(final)
            if self.is_chat:
                message: dict[str, Any] = {"role": "assistant", "content": ""}
                if calls:
                    message["tool_calls"] = [{"function": {"name": name, "arguments": _arguments(args)}}
                                             for name, args in calls.values()]
                last["message"] = message
            else:
                c = final.outputs[0]
                last["response"] = ""
                last["context"] = list(final.prompt_token_ids) + list(c.token_ids)
            yield json.dumps(last) + "\n"
        except STREAM_ERRORS as e:
            error = self.api_error(e).message
            yield json.dumps({"error": error}) + "\n"
        finally:
            watcher.cancel()
            stream.close()
            self.log_finish([final] if final is not None else [], error)


def _load_ns(raw: Request) -> int:
    """Nanoseconds the request waited for its model to load (a multi-model server's dispatch sets it)."""
    return int(getattr(raw.state, "model_wait_seconds", 0.0) * 1e9)


def _served_name(state: ServerState, name: str | None) -> str | None:
    """Ollama's NAME:latest is NAME."""
    if name is not None and name.endswith(":latest") and name not in state.served_model_names:
        return name.removesuffix(":latest")
    return name


# ---- routes -------------------------------------------------------------------------------------
def add_ollama_routes(app: FastAPI, state: ServerState) -> None:
    async def answer(work) -> Response:
        try:
            return await work()
        except APIError as e:
            state.log_refusal("POST", "/api", e)
            return ollama_error(e)

    @app.post("/api/chat")
    async def chat(raw: Request) -> Response:
        return await answer(lambda: _serve(raw, ChatRequest))

    @app.post("/api/generate")
    async def generate(raw: Request) -> Response:
        return await answer(lambda: _serve(raw, GenerateRequest))

    async def _serve(raw: Request, cls) -> Response:
        req = await parse_body(raw, cls)
        return await OllamaServing(state, req, raw).create()

    async def _embed(raw: Request, older: bool) -> Response:
        req = await parse_body(raw, EmbedRequest)
        if (req.prompt if older else req.input) is None:
            raise bad_request("prompt is required" if older else "input is required", "prompt" if older else "input")
        body = EmbeddingRequest(model=_served_name(state, req.model), input=req.prompt if older else req.input,
                                dimensions=req.dimensions)
        serving = EmbeddingServing(state, body, raw)
        data = json.loads((await serving.create()).body)
        vectors = [d["embedding"] for d in data["data"]]
        if older:
            return JSONResponse({"embedding": vectors[0]})
        return JSONResponse({"model": serving.model, "embeddings": vectors,
                             "total_duration": int((time.monotonic() - serving.arrival) * 1e9) + _load_ns(raw),
                             "load_duration": _load_ns(raw),
                             "prompt_eval_count": data["usage"]["prompt_tokens"]})

    @app.post("/api/embed")
    async def embed(raw: Request) -> Response:
        return await answer(lambda: _embed(raw, False))

    @app.post("/api/embeddings")
    async def embeddings(raw: Request) -> Response:
        return await answer(lambda: _embed(raw, True))

    @app.post("/api/show")
    async def show(raw: Request) -> Response:
        async def work():
            data = await raw.body()
            try:
                name = json.loads(data).get("model") or json.loads(data).get("name")
            except (ValueError, AttributeError):
                name = None
            state.check_model(_served_name(state, name))
            llm = state.llm
            template = getattr(llm.tokenizer, "chat_template", None) or ""
            capabilities = ["embedding"] if state.pooling else ["completion", "tools"]
            return JSONResponse({"modelfile": f"FROM {llm.model_path}\n", "parameters": "", "template": template,
                                 "details": model_details(llm.model_path, llm.config),
                                 "model_info": {"general.context_length": llm.max_model_len,
                                                "general.vocab_size": llm.vocab_size},
                                 "capabilities": capabilities, "modified_at": ollama_time(time.time())})
        return await answer(work)

    # One model: the set is this model (a multi-model server answers these itself).
    @app.get("/api/version")
    async def version() -> dict:
        return {"version": pagedserve.__version__}

    def _entry() -> dict[str, Any]:
        from pathlib import Path
        p = Path(state.llm.model_path)
        size = p.stat().st_size if p.is_file() else 0
        return ollama_model(state.model_name, state.llm.model_path, size, state.llm.config)

    @app.get("/api/tags")
    async def tags() -> dict:
        return {"models": [_entry()]}

    @app.get("/api/ps")
    async def ps() -> dict:
        return {"models": [{**_entry(), "expires_at": ollama_time(time.time() + 3.15e8), "size_vram": 0,
                            "context_length": state.llm.max_model_len}]}

    for path in NOT_SUPPORTED_PATHS:
        app.add_api_route(path, not_supported, methods=["POST", "DELETE", "GET", "HEAD"])
