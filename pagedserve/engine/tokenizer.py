"""The front end's tokenizer: made once per process, shared by everything outside the engine.

The engine thread has its own tokenizer (LLMEngine.tokenizer: prompts given as text, and the
output side's text); everything else in a server process (prompts and chat templates on the
prompt thread, /tokenize, /detokenize, the dashboard's block text, the data-parallel router's
prompt hashing) uses this one. With dummy weights (`load_format="dummy"`) a preset or a
directory without tokenizer files gets the stand-in (models/dummy.py), as the engine does, so
`pagedserve serve <preset> --load-format dummy` starts offline.

A fast tokenizer is not safe to call from two threads at once, so whoever tokenizes off the
event loop does it in a `TokenizerLane`: one thread and a tokenizer of its own. A lane holds at
most `max_jobs` jobs (the one running and those queued behind it; each holds its request's
text): one more is refused with QueueFullError, the 503 a full engine queue gives, so a flood of
prompts cannot queue without bound in front of the engine's own queue limit. A job whose caller
is cancelled leaves the queue (or, running, ends as an orphan whose result is dropped).
"""
from __future__ import annotations

import asyncio
import copy
import threading
from typing import Any, Callable

from pagedserve.engine.protocol import QueueFullError
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
    thread, at first use), for a lane beside others that use the same object. At most `max_jobs`
    jobs at a time (None: no bound); `run` is called from one event loop."""

    def __init__(self, name: str, tokenizer: Any, copy_tokenizer: bool, max_jobs: int | None = None) -> None:
        if max_jobs is not None and max_jobs < 1:
            raise ValueError(f"a tokenizer lane must take at least one job; got max_jobs={max_jobs}")
        self.name = name
        self.max_jobs = max_jobs
        self.num_jobs = 0            # (event loop) jobs submitted and not answered yet
        self._tokenizer = tokenizer
        self._copy = copy_tokenizer
        self._pool = CompilePool(1, max_orphans=0, name=name)

    def tokenizer(self) -> Any:
        """(The lane's thread.) Its tokenizer, copied on first use."""
        if self._copy:
            self._tokenizer, self._copy = copy.deepcopy(self._tokenizer), False
        return self._tokenizer

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(tokenizer, *args) on the lane's thread; QueueFullError if the lane is full."""
        if self.max_jobs is not None and self.num_jobs >= self.max_jobs:
            raise QueueFullError(f"the server is overloaded: {self.num_jobs} requests are already waiting for "
                                 f"the tokenizer ({self.name}) and at most {self.max_jobs} may wait "
                                 f"(--max-waiting-requests); retry later")
        task = self._pool.submit(lambda: fn(self.tokenizer(), *args))
        # Shielded: a cancelled caller must not cancel the future itself, or the pool would still
        # run the queued job; abandon() takes it out of the queue (and answers the future).
        answer = asyncio.wrap_future(task.future)
        answer.add_done_callback(_retrieve)
        self.num_jobs += 1
        try:
            return await asyncio.shield(answer)
        except asyncio.CancelledError:
            self._pool.abandon(task, RuntimeError("the caller left"))
            raise
        finally:
            self.num_jobs -= 1

    def close(self) -> None:
        self._pool.close(RuntimeError("shutting down: the tokenizer lane is closed"))


def _retrieve(answer: asyncio.Future) -> None:
    """An abandoned job's answer is read here, so asyncio does not log it as never retrieved."""
    if not answer.cancelled():
        answer.exception()
