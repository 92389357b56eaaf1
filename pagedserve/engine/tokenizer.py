"""The front end's tokenizer: made once per process, shared by everything outside the engine.

The engine thread has its own tokenizer (LLMEngine.tokenizer: prompts given as text, and the
output side's text); everything else in a server process (prompts and chat templates on the
prompt thread, /tokenize, /detokenize, the dashboard's block text, the data-parallel router's
prompt hashing) uses this one. With dummy weights (`load_format="dummy"`) a preset or a
directory without tokenizer files gets the stand-in (models/dummy.py), as the engine does, so
`pagedserve serve <preset> --load-format dummy` starts offline.
"""
from __future__ import annotations

import threading
from typing import Any

from pagedserve.models.loader import load_tokenizer

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
