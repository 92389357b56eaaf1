"""The front end's tokenizer: made once per process, shared by everything outside the engine.

The engine thread has its own tokenizer (LLMEngine.tokenizer: prompts given as text, and the
output side's text); everything else in a server process (prompts and chat templates on the
prompt thread, /tokenize, /detokenize, the dashboard's block text, the data-parallel router's
prompt hashing) uses this one. With dummy weights (`load_format="dummy"`) a preset or a
directory without tokenizer files gets the stand-in (models/dummy.py), as the engine does, so
`pagedserve serve <preset> --load-format dummy` starts offline.

A fast tokenizer is not safe to call from two threads at once, so whoever tokenizes off the
event loop does it in a `TokenizerLane`: one thread and a tokenizer of its own.
"""
from __future__ import annotations

import asyncio
import copy
import threading
from typing import Any, Callable

from pagedserve.models.loader import load_tokenizer
from pagedserve.structured.pool import CompilePool

_lock = threading.Lock()
_tokenizers: dict[tuple[str, bool, str | None], Any] = {}


def front_end_tokenizer(path: str, stand_in: bool = False, chat_template: str | None = None) -> Any:
    """The process's front-end tokenizer of the model at `path` (made on the first call, then
    the same object); `stand_in` for dummy weights; `chat_template` (a template's text), when
    given, replaces the model's, as it does the engine's."""
    key = (path, stand_in, chat_template)
    with _lock:
        tok = _tokenizers.get(key)
        if tok is None:
            tok = load_tokenizer(path, stand_in=stand_in)
            if chat_template is not None:
                tok.chat_template = chat_template
            _tokenizers[key] = tok
    return tok


def max_token_chars(tokenizer: Any) -> int:
    """The most characters one token of this vocabulary stands for: a text of more than
    max_model_len times this many characters cannot fit the context, tokenized or not."""
    return max(len(t) for t in tokenizer.get_vocab())


class TokenizerLane:
    """One thread and its own tokenizer: `copy_tokenizer` makes it a copy of `tokenizer` (on the
    thread, at first use), for a lane beside others that use the same object."""

    def __init__(self, name: str, tokenizer: Any, copy_tokenizer: bool) -> None:
        self._tokenizer = tokenizer
        self._copy = copy_tokenizer
        self._pool = CompilePool(1, max_orphans=0, name=name)

    def tokenizer(self) -> Any:
        """(The lane's thread.) Its tokenizer, copied on first use."""
        if self._copy:
            self._tokenizer, self._copy = copy.deepcopy(self._tokenizer), False
        return self._tokenizer

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(tokenizer, *args) on the lane's thread."""
        task = self._pool.submit(lambda: fn(self.tokenizer(), *args))
        return await asyncio.wrap_future(task.future)

    def close(self) -> None:
        self._pool.close(RuntimeError("shutting down: the tokenizer lane is closed"))
