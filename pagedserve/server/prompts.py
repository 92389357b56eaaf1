"""Prompts to token ids: cheap limits first, then the tokenizer, off the event loop.

Tokenizing a 10 MB prompt takes seconds; on the event loop that would freeze
/health and every stream meanwhile. So what can be refused without tokenizing
is refused first: more prompts than can ever be queued (checked on a plain JSON
parse, before pydantic, which takes seconds over a million prompts), token-id
prompts longer than the context, and text longer than the context could hold
(no token stands for more characters than the longest entry of the vocabulary).
Then the tokenizer and the chat template run on one worker thread: the fast
tokenizer releases the GIL while it works, and is not safe to call from two
threads at once.
"""
from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import pydantic_core

from pagedserve.server.errors import APIError, bad_request


def context_length_error(num_tokens: int, max_model_len: int, param: str) -> APIError:
    return bad_request(f"the prompt is {num_tokens} tokens long; this model's maximum context length is "
                       f"{max_model_len} tokens, which must also hold at least one generated token",
                       param, "context_length_exceeded")


def _text_chars(content: str | list | None) -> int:
    if isinstance(content, list):   # content parts: only text parts are accepted
        return sum(len(str(part.get("text", ""))) for part in content if isinstance(part, dict))
    return len(content or "")


class PromptProcessor:
    def __init__(self, tokenizer: Any, max_model_len: int, check_num_prompts: Callable[[int], None]) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self._check_num_prompts = check_num_prompts    # ValueError when over the limit
        self.max_token_chars = max(len(t) for t in tokenizer.get_vocab())
        self.max_chars = max_model_len * self.max_token_chars
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="pagedserve-tokenizer")

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
    async def _run(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    async def run(self, fn: Callable, *args: Any) -> Any:
        """fn(*args) on the tokenizer's thread: for others that use the front-end tokenizer (the
        dashboard's block text)."""
        return await self._run(fn, *args)

    async def encode(self, texts: list[str], param: str = "prompt", add_special_tokens: bool = True) -> list[list[int]]:
        for text in texts:
            self.check_chars(len(text), param)
        if not texts:
            return []   # token-id prompts do not wait behind other requests' tokenization
        return await self._run(lambda: [self.tokenizer.encode(t, add_special_tokens=add_special_tokens)
                                        for t in texts])

    async def render_chat(self, render: Callable[..., list[int]], messages: list, *args: Any) -> list[int]:
        """render(tokenizer, messages, *args) on the worker thread, after the character limit on
        the messages' text."""
        self.check_chars(sum(_text_chars(m.content) for m in messages), "messages")
        return await self._run(render, self.tokenizer, messages, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
