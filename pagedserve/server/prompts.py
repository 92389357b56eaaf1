"""Prompts to token ids: cheap limits first, then the tokenizer, off the event loop.

Tokenizing a 10 MB prompt takes seconds; on the event loop that would freeze
/health and every stream meanwhile. So what can be refused without tokenizing
is refused first: more prompts than can ever be queued (checked on a plain JSON
parse, before pydantic, which takes seconds over a million prompts), token-id
prompts longer than the context, and text longer than the context could hold
(no token stands for more characters than the longest entry of the vocabulary).
A chat's cheap limit counts its messages too: each renders at least the template's
overhead of a message (measured once, from the template), so 400,000 empty
messages are refused before the template renders millions of tokens.
Then the tokenizer and the chat template run off the event loop in two lanes, each
one thread with its own tokenizer (engine/tokenizer.py's TokenizerLane): requests estimated
small go to one, large ones to the other, so one huge request cannot hold every other
client's tokenizing for seconds. The threads are daemons: a render in progress never holds
the process's exit. Each lane holds a bounded number of requests (the running one and those
queued behind it): the small lane as many as may wait for the engine (--max-waiting-requests),
the large one at most LARGE_LANE_JOBS (each may hold a body of up to --max-request-body-bytes
and take seconds); one more gets the 503 (with Retry-After) a full queue gives.
"""
from __future__ import annotations

import json
import logging
from typing import Any, Callable

import pydantic_core

from pagedserve.engine.protocol import QueueFullError
from pagedserve.engine.tokenizer import TokenizerLane, max_token_chars
from pagedserve.server.errors import APIError, bad_request, queue_full

logger = logging.getLogger(__name__)

# Bodies from this size on have their items counted before they are parsed (smaller ones parse
# in well under a millisecond).
PRECHECK_BYTES = 64 * 1024


def _key_count(data: bytes, key: bytes) -> int:
    """How many times `"key"` occurs in a JSON body: its keys so named, and string values equal
    to it (one scan; a bound from above on the items that carry the key)."""
    return data.count(b'"' + key + b'"')


# A request whose text is estimated at more characters than this (or with more messages) goes to
# the large lane.
LARGE_CHARS = 64 * 1024
LARGE_MESSAGES = 256
# The most requests the large lane holds (when the queue limit is not lower).
LARGE_LANE_JOBS = 16


def context_length_error(num_tokens: int, max_model_len: int, param: str) -> APIError:
    return bad_request(f"the prompt is {num_tokens} tokens long; this model's maximum context length is "
                       f"{max_model_len} tokens, which must also hold at least one generated token",
                       param, "context_length_exceeded")


def _text_chars(content: str | list | None) -> int:
    if isinstance(content, list):   # content parts: only text parts are accepted
        return sum(len(str(part.get("text", ""))) for part in content if isinstance(part, dict))
    return len(content or "")


def _extra_chars(m: Any) -> int:
    """The characters of a message the template may show besides its content: name and earlier calls."""
    chars = len(getattr(m, "name", None) or "") + len(getattr(m, "tool_call_id", None) or "")
    calls = getattr(m, "tool_calls", None)
    if calls:
        chars += _json_chars(calls)
    return chars


def _json_chars(value: Any) -> int:
    try:
        return len(json.dumps(value, default=str))
    except (RecursionError, ValueError):
        return LARGE_CHARS + 1   # too deep to measure: the large lane (the template refuses it there)


class PromptProcessor:
    def __init__(self, tokenizer: Any, max_model_len: int, check_num_prompts: Callable[[int], None],
                 max_waiting_requests: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self._check_num_prompts = check_num_prompts    # ValueError when over the limit
        self.max_token_chars = max_token_chars(tokenizer)
        self.max_chars = max_model_len * self.max_token_chars
        large_jobs = min(max_waiting_requests or LARGE_LANE_JOBS, LARGE_LANE_JOBS)
        self._small = TokenizerLane("pagedserve-tokenizer", tokenizer, copy_tokenizer=False,
                                    max_jobs=max_waiting_requests)
        self._large = TokenizerLane("pagedserve-tokenizer-large", tokenizer, copy_tokenizer=True, max_jobs=large_jobs)
        self.message_tokens = self._measure_message_tokens(tokenizer)

    @staticmethod
    def _measure_message_tokens(tokenizer: Any) -> int:
        """The fewest tokens one more (empty) message adds to a rendered chat, at least 1."""
        from pagedserve.engine.chat import render_chat
        found = []
        for role in ("user", "assistant", "system"):
            try:
                one = render_chat(tokenizer, [{"role": role, "content": ""}], False)
                two = render_chat(tokenizer, [{"role": role, "content": ""}] * 2, False)
                found.append(len(two) - len(one))
            except Exception:   # noqa: BLE001 - a template may refuse such a chat: measure another
                continue
        return max(1, min(found, default=1))

    # ---- cheap limits (event loop) -------------------------------------------------------------
    def check_context(self, num_tokens: int, param: str) -> None:
        if num_tokens >= self.max_model_len:
            raise context_length_error(num_tokens, self.max_model_len, param)

    def check_num_prompts(self, num_prompts: int, param: str = "prompt") -> None:
        try:
            self._check_num_prompts(num_prompts)
        except ValueError as e:
            raise bad_request(str(e), param) from None

    def check_chars(self, num_chars: int, param: str) -> None:
        if num_chars > self.max_chars:
            raise bad_request(f"the prompt is {num_chars} characters long; this model's maximum context length "
                              f"is {self.max_model_len} tokens and no token of its tokenizer stands for more than "
                              f"{self.max_token_chars} characters, so at most {self.max_chars} characters fit",
                              param, "context_length_exceeded")

    def check_messages(self, num_messages: int, chars: int = 0, param: str = "messages") -> None:
        """A chat of this many messages renders at least message_tokens each, plus its text."""
        tokens = num_messages * self.message_tokens + chars // self.max_token_chars
        if tokens >= self.max_model_len:
            raise bad_request(f"the chat has {num_messages} messages (and {chars} characters of text); each message "
                              f"renders at least {self.message_tokens} tokens of this model's chat template, so it "
                              f"is at least {tokens} tokens long; this model's maximum context length is "
                              f"{self.max_model_len} tokens", param, "context_length_exceeded")

    # Before a body is parsed at all: parsing a 16 MB body of small objects holds the event loop
    # (and so every stream) for seconds, however it is done (JSON parsers hold the GIL). Counting
    # a key's bytes is a C scan without objects: a bound from above on the items that carry the
    # key (inside a JSON string its quotes are escaped, so only keys, and values equal to it, count).

    def precheck_chat_body(self, data: bytes) -> None:
        """A chat (or /tokenize) body's messages, counted before the body is parsed."""
        if len(data) >= PRECHECK_BYTES:
            self.check_messages(_key_count(data, b"role"))

    def precheck_responses_body(self, data: bytes) -> None:
        """A /v1/responses body's input items (messages have a role, calls and their outputs a
        call_id), counted before the body is parsed; each becomes a chat message."""
        if len(data) >= PRECHECK_BYTES:
            self.check_messages(_key_count(data, b"role") + _key_count(data, b"call_id"), param="input")

    def precheck_detokenize_body(self, data: bytes) -> None:
        """A /detokenize body's token ids (at most one more than its commas), counted before the
        body is parsed: no more than a context holds."""
        if len(data) >= PRECHECK_BYTES and data.count(b",") >= self.max_model_len:
            raise bad_request(f"at most {self.max_model_len} token ids (this model's context) are detokenized at "
                              f"once", "tokens")

    def precheck_completion_body(self, data: bytes) -> None:
        """The prompt count and token-id prompt lengths of a /v1/completions body, before the body
        is validated (an invalid body is left to the validation to describe)."""
        try:
            prompt = pydantic_core.from_json(data).get("prompt")
        except (ValueError, AttributeError):
            return
        if not isinstance(prompt, list) or not prompt:
            return
        prompts = [prompt] if isinstance(prompt[0], int) else prompt
        self.check_num_prompts(len(prompts))
        for p in prompts:
            if isinstance(p, list):
                self.check_context(len(p), "prompt")

    # ---- off the event loop ----------------------------------------------------------------------
    def _lane(self, chars: int, num_messages: int = 0) -> TokenizerLane:
        return self._large if chars > LARGE_CHARS or num_messages > LARGE_MESSAGES else self._small

    @staticmethod
    async def _run_in(lane: TokenizerLane, fn: Callable, *args: Any) -> Any:
        """fn(tokenizer, *args) in `lane`; a full lane is the full queue's 503."""
        try:
            return await lane.run(fn, *args)
        except QueueFullError as e:
            raise queue_full(e) from None

    async def run(self, fn: Callable, *args: Any) -> Any:
        """fn(*args) on the tokenizer's thread: for others that use the front-end tokenizer (the
        dashboard's block text), in the small lane: fn does not take the tokenizer."""
        return await self._run_in(self._small, lambda _tokenizer: fn(*args))

    async def encode(self, texts: list[str], param: str = "prompt", add_special_tokens: bool = True) -> list[list[int]]:
        for text in texts:
            self.check_chars(len(text), param)
        if not texts:
            return []   # token-id prompts do not wait behind other requests' tokenization
        return await self._run_in(self._lane(sum(map(len, texts))),
                                  lambda tok: [tok.encode(t, add_special_tokens=add_special_tokens) for t in texts])

    async def render_chat(self, render: Callable[..., list[int]], messages: list, *args: Any,
                          tools: list | None = None) -> list[int]:
        """render(tokenizer, messages, *args) off the event loop, after the limits on the
        messages' text and count (`tools`: the definitions the template will show, counted too)."""
        chars = sum(_text_chars(m.content) for m in messages)   # text every template shows
        self.check_chars(chars, "messages")
        self.check_messages(len(messages), chars)
        # The lane by all the text the template may show (names, earlier calls, tool definitions).
        size = chars + sum(_extra_chars(m) for m in messages) + (_json_chars(tools) if tools else 0)
        return await self._run_in(self._lane(size, len(messages)), render, messages, *args)

    def close(self) -> None:
        self._small.close()
        self._large.close()
