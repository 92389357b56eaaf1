"""Incremental detokenization and stop strings, one instance per sequence.

Text grows token by token through the tokenizers library's DecodeStream, which
holds back bytes until they form whole UTF-8 characters. Decoding starts a few
prompt tokens back so the first generated token gets its leading space right.
"""
from __future__ import annotations

import copy

from tokenizers.decoders import DecodeStream

_PROMPT_CONTEXT = 4


class IncrementalDetokenizer:
    def __init__(self, backend_tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool,
                 stop_strings: list[str], include_stop_str_in_output: bool) -> None:
        self.tokenizer = backend_tokenizer
        self.stream = DecodeStream(ids=prompt_token_ids[-_PROMPT_CONTEXT:], skip_special_tokens=skip_special_tokens)
        self.text = ""
        self.stop_strings = stop_strings
        self.include_stop = include_stop_str_in_output
        # While generating, the last few characters could be the start of a stop string,
        # so they are not shown yet.
        self.holdback = 0 if include_stop_str_in_output else max((len(s) for s in stop_strings), default=1) - 1

    def fork(self) -> "IncrementalDetokenizer":
        clone = copy.copy(self)
        clone.stream = copy.copy(self.stream)
        return clone

    def add_token(self, token_id: int, check_stop: bool) -> str | None:
        """Append a token's text; returns the stop string if one now appears."""
        chunk = self.stream.step(self.tokenizer, token_id)
        if not chunk:
            return None
        start = max(0, len(self.text) - max((len(s) for s in self.stop_strings), default=0) + 1)
        self.text += chunk
        if not check_stop:
            return None
        hits = [(idx, stop) for stop in self.stop_strings if (idx := self.text.find(stop, start)) != -1]
        if not hits:
            return None
        idx, stop = min(hits)   # the earliest stop string wins
        self.text = self.text[:idx + len(stop)] if self.include_stop else self.text[:idx]
        return stop

    def visible_text(self, finished: bool) -> str:
        if finished or not self.holdback:
            return self.text
        return self.text[:max(0, len(self.text) - self.holdback)]
