"""/v1/completions and /v1/chat/completions: request -> engine requests -> response or SSE.

Both endpoints share the machinery: check the request, turn it into one engine
request per prompt (SamplingParams or BeamSearchParams), submit them as one
unit, then either wait for the final outputs or stream deltas. Engine outputs
are cumulative, so each choice remembers how much text and how many tokens it
has sent. A client that goes away aborts its requests at once.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from functools import lru_cache

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from jinja2 import TemplateError
from pydantic import BaseModel

from pagedserve.chat_templates import tools_warning, warning_headers
from pagedserve.engine.async_llm import (EngineDeadError, EngineNotReadyError, EngineStepError, QueueFullError,
                                         RequestStream)
from pagedserve.engine.chat import RESERVED_KWARGS
from pagedserve.engine.llm import render_chat
from pagedserve.errors import InvalidRequestError
from pagedserve.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from pagedserve.sampling_params import BeamSearchParams, SamplingParams
from pagedserve.server.errors import APIError, bad_request, queue_full
from pagedserve.server.reasoning import ReasoningStreamer, split_reasoning
from pagedserve.server.protocol import (ChatChoice, ChatCompletionChunk, ChatCompletionRequest,
                                        ChatCompletionResponse, ChatLogprobs, ChatMessage, ChatResponseMessage,
                                        ChatStreamChoice, ChatTokenLogprob, CompletionChoice, CompletionChunk,
                                        CompletionLogprobs, CompletionRequest, CompletionResponse, DeltaMessage,
                                        SamplingRequest, TopLogprob, UsageInfo, random_id)
from pagedserve.server.state import ServerState
from pagedserve.server.structured import build_constraint, requested_constraint
from pagedserve.server.tools import ToolStreamer, parse_tool_calls, plan_tools
from pagedserve.structured.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

# What a request's stream can raise once it was accepted: Serving.api_error turns each into a reply.
STREAM_ERRORS = (APIError, InvalidRequestError, EngineStepError, EngineDeadError)

# Request fields we do not know were logged once each (vLLM logs them too), not silently dropped.
_ignored_fields_logged: set[str] = set()

Params = SamplingParams | BeamSearchParams

# ---- request -> engine --------------------------------------------------------------------------
def check_max_tokens(requested: int | None, explicit: bool, prompt_len: int, max_model_len: int) -> None:
    """An explicit max_tokens that does not fit with the prompt is an error, as in OpenAI's API
    (the engine cuts a default one to what fits, and refuses a prompt that leaves no room)."""
    if explicit and requested is not None and requested >= 1 and prompt_len < max_model_len \
            and prompt_len + requested > max_model_len:
        raise bad_request(f"this model's maximum context length is {max_model_len} tokens, but "
                          f"{prompt_len + requested} were requested: {prompt_len} in the prompt and "
                          f"{requested} for the completion; shorten the prompt or lower max_tokens",
                          "max_tokens", "context_length_exceeded")


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """JSON keys are strings: token ids in decimal digits (the engine checks the vocabulary)."""
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        # Plain ASCII digits only: int() would also take "1_0", " 10 " and other scripts' digits.
        if not re.fullmatch(r"[0-9]+", key):
            raise bad_request(f"logit_bias keys must be token ids in decimal digits, got {key!r}", "logit_bias")
        out[int(key)] = value
    return out


def make_params(req: SamplingRequest, max_tokens: int | None, logprobs: int | None,
                prompt_logprobs: int | None = None, logprobs_param: str = "logprobs",
                structured: StructuredOutputsParams | None = None, defaults: dict | None = None) -> Params:
    """The request's sampling (or beam search) parameters; max_tokens None: up to the context.
    `defaults`: the model's sampling defaults (generation_config.json) for fields the request
    leaves unset."""
    if req.use_beam_search and structured is not None:
        raise bad_request("structured outputs and tools are not supported with use_beam_search", "use_beam_search")
    defaults = defaults or {}

    def value(name: str, fallback):
        given = getattr(req, name)
        return given if given is not None else defaults.get(name, fallback)
    if req.use_beam_search:
        if req.stop or req.stop_token_ids:
            raise bad_request("stop and stop_token_ids are not supported with use_beam_search", "stop")
        if logprobs is not None:
            raise bad_request("logprobs are not supported with use_beam_search", logprobs_param)
        width = req.best_of or req.n
        if width < req.n:
            raise bad_request(f"best_of ({width}) must be >= n ({req.n})", "best_of")
    try:
        if req.use_beam_search:
            return BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=req.ignore_eos,
                                    length_penalty=req.length_penalty)
        return SamplingParams(
            n=req.n, best_of=req.best_of,
            temperature=value("temperature", 1.0), top_p=value("top_p", 1.0), top_k=value("top_k", 0),
            min_p=value("min_p", 0.0),
            seed=req.seed,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=value("repetition_penalty", 1.0),
            logit_bias=_logit_bias(req.logit_bias),
            max_tokens=max_tokens, min_tokens=req.min_tokens,
            stop=req.stop, stop_token_ids=req.stop_token_ids,
            include_stop_str_in_output=req.include_stop_str_in_output, ignore_eos=req.ignore_eos,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs, skip_special_tokens=req.skip_special_tokens,
            structured_outputs=structured)
    except InvalidRequestError as e:
        raise bad_request(e.message, logprobs_param if e.param == "logprobs" else e.param, e.code) from None


def completion_prompts(prompt: str | list) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt or isinstance(prompt[0], int):
        return [prompt]   # one prompt of token ids ([] is refused as empty by the engine)
    return list(prompt)


def chat_prompt_ids(tokenizer, messages: list[ChatMessage], add_generation_prompt: bool,
                    continue_final_message: bool = False, chat_template_kwargs: dict | None = None,
                    tools: list[dict] | None = None) -> list[int]:
    conversation = []
    for m in messages:
        content = m.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text":
                    raise bad_request(f"only text content parts are supported, got {part.get('type')!r}",
                                      "messages")
                texts.append(str(part.get("text", "")))
            content = "\n".join(texts)
        message = {"role": m.role, "content": content or ""}
        for key in ("name", "tool_calls", "tool_call_id"):   # the template decides what to show
            if getattr(m, key) is not None:
                message[key] = getattr(m, key)
        conversation.append(message)
    try:
        return render_chat(tokenizer, conversation, add_generation_prompt,
                           continue_final_message=continue_final_message, chat_template_kwargs=chat_template_kwargs,
                           tools=tools)
    except (ValueError, TypeError, KeyError, AttributeError, IndexError, RecursionError, TemplateError) as e:
        # The template met a message shape it does not take (the client's data, not our fault).
        raise bad_request(f"could not render the chat template: {type(e).__name__}: {e}", "messages") from None


# Names apply_chat_template and the template renderer take as their own arguments, and the
# template's conversation: none may come from chat_template_kwargs (the engine's set, and the
# renderer's own names, refused by the server only).
RESERVED_TEMPLATE_KWARGS = frozenset(RESERVED_KWARGS | {"conversations", "kwargs", "self"})


def check_chat_options(body: ChatCompletionRequest) -> None:
    """vLLM's 400s for chat options that cannot go together."""
    if body.continue_final_message and body.add_generation_prompt and \
            "add_generation_prompt" in body.model_fields_set:
        raise bad_request("continue_final_message and add_generation_prompt cannot both be true",
                          "continue_final_message")
    reserved = RESERVED_TEMPLATE_KWARGS & set(body.chat_template_kwargs or ())
    if reserved:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(sorted(reserved))}: the server sets them",
                          "chat_template_kwargs")


# ---- logprobs -----------------------------------------------------------------------------------
def _finite(logprob: float) -> float:
    """JSON has no -inf or NaN."""
    return max(logprob, -9999.0) if logprob == logprob else -9999.0


class TokenTexts:
    """Each token's own text: the engine's (each logprob entry's decoded_token, made on its output
    side), decoded here only for a position the engine sent none for (the prompt's first token)."""

    def __init__(self, tokenizer, as_token_ids: bool = False) -> None:
        # --return-tokens-as-token-ids: "token_id:N", as vLLM names them.
        decode = (lambda token: f"token_id:{token}") if as_token_ids else (lambda token: tokenizer.decode([token]))
        self.text = lru_cache(maxsize=1 << 16)(decode)
        self.as_token_ids = as_token_ids

    def of(self, token: int, pos: PositionLogprobs | None) -> str:
        lp = pos.get(token) if pos is not None and not self.as_token_ids else None
        return lp.decoded_token if lp is not None and lp.decoded_token is not None else self.text(token)

    def completion_logprobs(self, token_ids: list[int], positions: list[PositionLogprobs | None],
                            offset: int, out: CompletionLogprobs) -> int:
        """Append positions to `out` (OpenAI's completions shape); returns the next text offset."""
        for token, pos in zip(token_ids, positions):
            text = self.of(token, pos)
            out.tokens.append(text)
            out.text_offset.append(offset)
            offset += len(text)
            if pos is None:   # the first prompt token has no logprob
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(_finite(pos[token].logprob))
            top: dict[str, float] = {}
            for t, lp in pos.items():   # tokens with the same text (e.g. partial bytes) keep the best
                text_t, value = self.of(t, pos), _finite(lp.logprob)
                top[text_t] = max(value, top.get(text_t, value))
            out.top_logprobs.append(top)
        return offset

    def chat_logprobs(self, token_ids: list[int], positions: list[PositionLogprobs], top: int) -> ChatLogprobs:
        content = []
        for token, pos in zip(token_ids, positions):
            ranked = sorted((lp.rank, t, lp.logprob) for t, lp in pos.items()
                            if lp.rank is not None and lp.rank <= top)
            text = self.of(token, pos)
            content.append(ChatTokenLogprob(
                token=text, logprob=_finite(pos[token].logprob), bytes=list(text.encode()),
                top_logprobs=[TopLogprob(token=self.of(t, pos), logprob=_finite(lp),
                                         bytes=list(self.of(t, pos).encode())) for _, t, lp in ranked]))
        return ChatLogprobs(content=content)


# ---- shared machinery ---------------------------------------------------------------------------
@dataclass
class ChoiceDelta:
    """What one choice gained since the last chunk."""
    index: int                       # the choice's index in the response
    prompt_index: int
    request: RequestOutput
    output: CompletionOutput         # cumulative
    text: str
    new_tokens: slice                # positions of output.token_ids not sent yet
    first: bool
    finished: bool


class _ChoiceState:
    def __init__(self) -> None:
        self.text_len = 0
        self.num_tokens = 0
        self.chars_sent = 0          # everything sent, echo included (for text offsets)
        self.started = False
        self.finished = False


def _sse(model: BaseModel | dict) -> str:
    body = model.model_dump_json() if isinstance(model, BaseModel) else json.dumps(model)
    return f"data: {body}\n\n"


class Serving:
    """One request being served; subclasses shape the responses."""
    id_prefix = "cmpl"
    prompt_param = "prompt"
    renamed_params: dict[str, str] = {}    # the engine's parameter names -> this endpoint's

    def __init__(self, state: ServerState, body: SamplingRequest, raw: Request) -> None:
        self.start_request(state, body, raw)
        if state.pooling:
            raise bad_request("this server runs a pooling model (--runner pooling): it serves /v1/embeddings, not "
                              "generation", "model")
        for name in ("n", "best_of"):   # checked first: both are sequence counts from here on
            value = getattr(body, name)
            if value is not None and value < 1:
                raise bad_request(f"{name} must be an integer >= 1, got {value}", name)
        # (More sequences than the engine runs at once: refused by the engine, like every check
        # that depends on its configuration.)
        self.n = body.n
        self.texts = TokenTexts(self.llm.tokenizer, state.options.return_tokens_as_token_ids)
        self.prompt_tokens: dict[int, int] = {}
        self._choices: dict[int, _ChoiceState] = {}
        include = body.stream_options.include_usage if body.stream_options else False
        self.stream_usage = bool(body.stream and include)
        self.continuous_usage = bool(self.stream_usage and body.stream_options.continuous_usage_stats)
        if body.stream and body.best_of is not None and body.best_of > body.n and not body.use_beam_search:
            raise bad_request("best_of > n is not supported with stream", "best_of")
        new_ignored = set(body.model_extra or ()) - _ignored_fields_logged
        if new_ignored:
            _ignored_fields_logged.update(new_ignored)
            logger.warning("ignoring request field(s) pagedserve does not support: %s (logged once per field)",
                           ", ".join(sorted(new_ignored)))
        self.defaults = self.llm.default_sampling
        self.warning: str | None = None     # sent in a Warning header (tools the template does not show)
        self.constraint_field: str | None = None   # the field of the request's output constraint, if any

    def start_request(self, state: ServerState, body, raw: Request) -> None:
        """What every request has (generating or pooling): its ids, clock and model (or adapter)."""
        self.state, self.llm, self.body, self.raw = state, state.llm, body, raw
        self.arrival = time.monotonic()
        self.id = random_id(self.id_prefix)
        self.created = int(time.time())
        self.model = state.check_model(body.model)
        self.lora = state.lora_request(body.model)     # the adapter the model field names, if any

    def log_start(self, items: list) -> None:
        if not self.state.log_requests:
            return
        p = items[0][2]
        if isinstance(p, BeamSearchParams):
            what = f"beam_width={p.beam_width}, max_tokens={p.max_tokens}"
        else:
            what = (f"n={p.n}, temperature={p.temperature}, top_p={p.top_p}, top_k={p.top_k}, "
                    f"max_tokens={p.max_tokens}, seed={p.seed}")
        if self.lora is not None:
            what += f", lora={self.lora.lora_name!r}"
        logger.info("request %s: %d prompt(s) of %s tokens, %s, stream=%s", self.id, len(items),
                    "/".join(str(len(ids)) for _, ids, _ in items), what, bool(self.body.stream))

    def log_finish(self, finals: list[RequestOutput] | None, error: str | None = None) -> None:
        if not self.state.log_requests:
            return
        if error is not None:
            logger.info("request %s failed: %s", self.id, error)
            return
        reasons = [c.finish_reason for o in finals or [] for c in self.returned(o)]
        tokens = sum(len(c.token_ids) for o in finals or [] for c in self.returned(o))
        logger.info("request %s finished: %s, %d completion tokens", self.id, ",".join(map(str, reasons)) or
                    "aborted", tokens)

    async def constraint(self, extra: tuple[str, dict] | None = None) -> StructuredOutputsParams | None:
        """The request's output constraint (response_format, structured_outputs, guided_*, or
        `extra` from its tools), parsed off the event loop; 400 naming the field if bad."""
        found = requested_constraint(self.body)
        if found is not None and extra is not None:
            raise bad_request(f"{found[0]} cannot be combined with a tool_choice that calls a tool", found[0])
        found = found or extra
        if found is None:
            return None
        self.constraint_field = found[0]
        return await asyncio.to_thread(build_constraint, *found)

    # -- submit and wait --------------------------------------------------------------------------
    async def submit(self, items: list[tuple[str | None, list[int], Params]]) -> RequestStream:
        engine_items = [(f"{self.id}-{i}", {"prompt": text, "prompt_token_ids": ids,
                                            "cache_salt": self.body.cache_salt, "lora_request": self.lora}, params)
                        for i, (text, ids, params) in enumerate(items)]
        try:
            stream = await self.llm.add_requests(engine_items, self.arrival)
            self.log_start(items)
            return stream
        except EngineNotReadyError as e:
            raise APIError(503, f"the server cannot take requests now: {e}") from None
        except QueueFullError as e:
            raise queue_full(e) from None
        except InvalidRequestError as e:   # the engine's validation: param None or "prompt" is our prompt field
            param = self.prompt_param if e.param in (None, "prompt") else self.renamed_params.get(e.param, e.param)
            raise bad_request(e.message, param, e.code) from None
        except ValueError as e:            # the front end's own limits (e.g. prompts per request)
            raise bad_request(str(e), self.prompt_param) from None

    async def _abort_on_disconnect(self, stream: RequestStream) -> None:
        while True:
            message = await self.raw.receive()
            if message["type"] == "http.disconnect":
                if not stream.finished:
                    logger.info("client disconnected: aborting %s", self.id)
                    stream.abort()
                return

    def _check_aborted(self, out: RequestOutput) -> None:
        if out.finished and (not out.outputs or any(c.finish_reason == "abort" for c in out.outputs)):
            why = "the server is shutting down" if self.state.shutting_down else "the request was aborted"
            raise APIError(503, f"request aborted: {why}")

    def engine_refusal(self, e: InvalidRequestError) -> APIError:
        """A request refused by the engine after it was queued (its grammar failed to compile, took
        too long, matches nothing): a 400 naming the field the client used."""
        param = e.param
        if param and param.startswith("structured_outputs") and self.constraint_field:
            param = self.constraint_field
        return bad_request(e.message, param, e.code)

    def api_error(self, e: Exception) -> APIError:
        """What the client sees of an error raised while its request streamed (one of STREAM_ERRORS)."""
        if isinstance(e, APIError):
            return e
        if isinstance(e, InvalidRequestError):
            return self.engine_refusal(e)
        return APIError(500, str(e))

    async def first_output(self, stream: RequestStream, outputs: AsyncIterator[RequestOutput]) -> list[RequestOutput]:
        """A constrained request can still be refused after it is queued (its grammar fails to
        compile): before a stream starts, wait for its first output, so that a refusal is a 400,
        not an error event in a 200 stream. Unconstrained requests start at once."""
        if self.constraint_field is None:
            return []
        watcher = asyncio.create_task(self._abort_on_disconnect(stream))
        try:
            return [await outputs.__anext__()]
        except StopAsyncIteration:
            return []
        except InvalidRequestError as e:
            stream.close()
            self.log_finish(None, e.message)
            raise self.engine_refusal(e) from None
        except BaseException:
            stream.close()
            raise
        finally:
            watcher.cancel()

    async def final_outputs(self, stream: RequestStream) -> list[RequestOutput]:
        watcher = asyncio.create_task(self._abort_on_disconnect(stream))
        finals: dict[str, RequestOutput] = {}
        try:
            async for out in stream:
                if out.finished:
                    self._check_aborted(out)
                    finals[out.request_id] = out
        except STREAM_ERRORS as e:
            error = self.api_error(e)
            self.log_finish(None, error.message)
            raise error from None
        finally:
            watcher.cancel()
            stream.close()
        outputs = [finals[rid] for rid in stream.request_ids]
        self.log_finish(outputs)
        return outputs

    def usage(self, finals: list[RequestOutput]) -> UsageInfo:
        prompt = sum(len(o.prompt_token_ids) for o in finals)
        completion = sum(len(c.token_ids) for o in finals for c in self.returned(o))
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    def returned(self, out: RequestOutput) -> list[CompletionOutput]:
        """The outputs the client sees: beam search returns beam_width sequences, we return n."""
        return [c for c in out.outputs if c.index < self.n]

    # -- streaming --------------------------------------------------------------------------------
    def deltas(self, prompt_index: int, out: RequestOutput) -> Iterator[ChoiceDelta]:
        for c in self.returned(out):
            index = prompt_index * self.n + c.index
            st = self._choices.setdefault(index, _ChoiceState())
            if st.finished:
                continue
            text = c.text[st.text_len:]
            new = slice(st.num_tokens, len(c.token_ids))
            finished = c.finish_reason is not None
            if not (text or new.stop > new.start or finished or not st.started):
                continue
            first = not st.started
            st.started, st.finished = True, finished
            st.text_len, st.num_tokens = len(c.text), len(c.token_ids)
            yield ChoiceDelta(index, prompt_index, out, c, text, new, first, finished)

    def stream_usage_info(self) -> UsageInfo:
        prompt = sum(self.prompt_tokens.values())
        completion = sum(st.num_tokens for st in self._choices.values())
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)

    def chunk_for(self, delta: ChoiceDelta) -> BaseModel:
        raise NotImplementedError

    def usage_chunk(self) -> BaseModel:
        raise NotImplementedError

    async def streaming_response(self, stream: RequestStream) -> StreamingResponse:
        outputs = stream.__aiter__()
        first = await self.first_output(stream, outputs)
        return StreamingResponse(self._events(stream, outputs, first), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", **warning_headers(self.warning)})

    async def _events(self, stream: RequestStream, outputs: AsyncIterator[RequestOutput],
                      first: list[RequestOutput]) -> AsyncIterator[str]:
        watcher = asyncio.create_task(self._abort_on_disconnect(stream))
        prompt_index = {rid: i for i, rid in enumerate(stream.request_ids)}
        last: dict[str, RequestOutput] = {}
        error = None
        try:
            async for out in chained(first, outputs):
                self._check_aborted(out)
                last[out.request_id] = out
                i = prompt_index[out.request_id]
                self.prompt_tokens[i] = len(out.prompt_token_ids)
                for delta in self.deltas(i, out):
                    chunk = self.chunk_for(delta)
                    if self.continuous_usage:
                        chunk.usage = self.stream_usage_info()
                    yield _sse(chunk)
            if self.stream_usage:
                yield _sse(self.usage_chunk())
        except STREAM_ERRORS as e:
            failure = self.api_error(e)
            error = failure.message
            yield _sse(failure.body())
        finally:
            watcher.cancel()
            stream.close()
            self.log_finish(list(last.values()), error)
        yield "data: [DONE]\n\n"


async def chained(first: list[RequestOutput], rest: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    """The outputs a stream already gave (Serving.first_output), then the rest."""
    for out in first:
        yield out
    async for out in rest:
        yield out


# ---- /v1/completions ----------------------------------------------------------------------------
class CompletionServing(Serving):
    id_prefix = "cmpl"
    prompt_param = "prompt"
    body: CompletionRequest

    async def create(self) -> JSONResponse | StreamingResponse:
        body, llm = self.body, self.llm
        if body.suffix:
            raise bad_request("suffix is not supported", "suffix")
        explicit = "max_tokens" in body.model_fields_set
        max_tokens = body.max_tokens if explicit else self.defaults.get("max_tokens", body.max_tokens)
        prompt_logprobs = body.logprobs if body.echo and body.logprobs is not None else None
        items = []
        self.prompt_texts: list[str] = []
        prompts = completion_prompts(body.prompt)
        self.state.prompts.check_num_prompts(len(prompts))
        structured = await self.constraint()
        encoded = iter(await self.state.prompts.encode([p for p in prompts if isinstance(p, str)]))
        for prompt in prompts:
            if isinstance(prompt, str):
                text, ids = prompt, next(encoded)
            else:
                text, ids = None, list(prompt)
            check_max_tokens(max_tokens, explicit, len(ids), llm.max_model_len)
            params = make_params(body, max_tokens, body.logprobs, prompt_logprobs, structured=structured,
                                 defaults=self.defaults)
            items.append((text, ids, params))
        stream = await self.submit(items)
        for text, ids, _ in items:
            self.prompt_texts.append(text if text is not None or not body.echo else llm.tokenizer.decode(ids))
        if body.stream:
            return await self.streaming_response(stream)
        finals = await self.final_outputs(stream)
        choices = []
        for i, out in enumerate(finals):
            for c in self.returned(out):
                choices.append(self._choice(i * self.n + c.index, i, out, c, c.text, slice(0, len(c.token_ids)),
                                            echo=body.echo))
        response = CompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                      usage=self.usage(finals))
        return JSONResponse(response.model_dump())

    def _choice(self, index: int, prompt_index: int, out: RequestOutput, c: CompletionOutput, text: str,
                new: slice, echo: bool, offset: int = 0) -> CompletionChoice:
        prompt_text = self.prompt_texts[prompt_index] if echo else ""
        logprobs = None
        if self.body.logprobs is not None:
            logprobs = CompletionLogprobs()
            if echo:
                self.texts.completion_logprobs(out.prompt_token_ids, out.prompt_logprobs or [], offset, logprobs)
            self.texts.completion_logprobs(c.token_ids[new], (c.logprobs or [])[new], offset + len(prompt_text),
                                           logprobs)
        return CompletionChoice(index=index, text=prompt_text + text, logprobs=logprobs,
                                finish_reason=c.finish_reason, stop_reason=c.stop_reason)

    def chunk_for(self, delta: ChoiceDelta) -> BaseModel:
        st = self._choices[delta.index]
        choice = self._choice(delta.index, delta.prompt_index, delta.request, delta.output, delta.text,
                              delta.new_tokens, echo=self.body.echo and delta.first, offset=st.chars_sent)
        st.chars_sent += len(choice.text)
        return CompletionChunk(id=self.id, created=self.created, model=self.model, choices=[choice])

    def usage_chunk(self) -> BaseModel:
        return CompletionChunk(id=self.id, created=self.created, model=self.model, choices=[],
                               usage=self.stream_usage_info())


# ---- /v1/chat/completions -----------------------------------------------------------------------
class ChatServing(Serving):
    id_prefix = "chatcmpl"
    prompt_param = "messages"
    renamed_params = {"logprobs": "top_logprobs"}
    body: ChatCompletionRequest

    async def create(self) -> JSONResponse | StreamingResponse:
        body = self.body
        if body.top_logprobs is not None and not body.logprobs:
            raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")
        self.top = (body.top_logprobs or 0) if body.logprobs else None
        check_chat_options(body)
        explicit = bool({"max_tokens", "max_completion_tokens"} & body.model_fields_set)
        requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if not explicit:
            requested = self.defaults.get("max_tokens", requested)
        add_generation_prompt = body.add_generation_prompt and not body.continue_final_message
        stream = await self.submit_chat(add_generation_prompt, body.continue_final_message, body.chat_template_kwargs,
                                        requested, explicit)
        if body.stream:
            return await self.streaming_response(stream)
        (final,) = await self.final_outputs(stream)
        choices = [self._choice(c) for c in self.returned(final)]
        response = ChatCompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                          usage=self.usage([final]))
        return JSONResponse(response.model_dump(), headers=warning_headers(self.warning))

    async def submit_chat(self, add_generation_prompt: bool, continue_final_message: bool,
                          template_kwargs: dict | None, requested: int | None, explicit: bool) -> RequestStream:
        """Plan the tools, build the constraint, render the conversation off the event loop and
        submit it (chat completions and /v1/responses)."""
        body = self.body
        self.tools = plan_tools(body, self.state.enable_auto_tool_choice, self.state.tool_call_parser)
        if self.tools is not None:
            self.warning = tools_warning(self.llm.tokenizer.chat_template, logger)
        self._streamers: dict[int, ToolStreamer] = {}
        self._thinkers: dict[int, ReasoningStreamer] = {}     # per choice, with a reasoning parser
        tool_constraint = ("tools", self.tools.constraint) if self.tools and self.tools.constraint else None
        structured = await self.constraint(tool_constraint)
        tools = self.tools.tools if self.tools else None
        ids = await self.state.prompts.render_chat(chat_prompt_ids, body.messages, add_generation_prompt,
                                                   continue_final_message, template_kwargs, tools, tools=tools)
        try:
            check_max_tokens(requested, explicit, len(ids), self.llm.max_model_len)
        except APIError as e:
            e.param = self.renamed_params.get("max_tokens", "max_tokens")
            raise
        params = make_params(body, requested, self.top, logprobs_param="top_logprobs", structured=structured,
                             defaults=self.defaults)
        return await self.submit([(None, ids, params)])

    def _choice(self, c: CompletionOutput) -> ChatChoice:
        reasoning, content, calls = None, c.text, []
        if self.state.reasoning_parser:       # the <think> block first; tool calls are in what follows it
            reasoning, content = split_reasoning(self.state.reasoning_parser, c.text)
        if self.tools is not None and content is not None:
            content, calls = parse_tool_calls(self.tools, content)
        message = ChatResponseMessage(role=self.state.options.response_role, content=content, tool_calls=calls,
                                      reasoning_content=reasoning)
        return ChatChoice(index=c.index, message=message,
                          logprobs=self._logprobs(c, slice(0, len(c.token_ids))),
                          finish_reason=self._finish_reason(c.finish_reason, bool(calls)), stop_reason=c.stop_reason)

    @staticmethod
    def _finish_reason(reason: str | None, called: bool) -> str | None:
        return "tool_calls" if called and reason == "stop" else reason

    def _logprobs(self, c: CompletionOutput, new: slice) -> ChatLogprobs | None:
        if self.top is None:
            return None
        return self.texts.chat_logprobs(c.token_ids[new], (c.logprobs or [])[new], self.top)

    def chunk_for(self, delta: ChoiceDelta) -> BaseModel:
        c = delta.output
        reasoning, content, calls = None, delta.text, None
        finish_reason = c.finish_reason
        if self.state.reasoning_parser:
            thinker = self._thinkers.setdefault(delta.index, ReasoningStreamer(self.state.reasoning_parser))
            reasoning, content = thinker.feed(delta.text, delta.finished)
        if self.tools is not None:
            streamer = self._streamers.setdefault(delta.index, ToolStreamer(self.tools))
            content, calls = streamer.feed(content or "", delta.finished)
            calls = calls or None
            finish_reason = self._finish_reason(finish_reason, streamer.calls > 0)
        message = DeltaMessage(role=self.state.options.response_role if delta.first else None, content=content,
                               tool_calls=calls, reasoning_content=reasoning)
        choice = ChatStreamChoice(index=delta.index, delta=message, logprobs=self._logprobs(c, delta.new_tokens),
                                  finish_reason=finish_reason if delta.finished else None,
                                  stop_reason=c.stop_reason if delta.finished else None)
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[choice])

    def usage_chunk(self) -> BaseModel:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[],
                                   usage=self.stream_usage_info())
