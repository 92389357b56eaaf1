"""Token text, the engine's output side: the one place text is made.

`OutputText` runs after the scheduler has applied a step (appended its tokens): it grows each
sequence's text, checks the stop strings there (a hit ends the sequence through the
scheduler), and gives each logprob entry its token's text. The scheduler knows no text.

Text grows token by token through the tokenizers library's DecodeStream (one
`IncrementalDetokenizer` per sequence), which holds back bytes until they form whole UTF-8
characters. Decoding starts a few prompt tokens back so the first generated token gets its
leading space right.
"""
from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING, Any

from tokenizers.decoders import DecodeStream

from pagedserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedserve.outputs import PositionLogprobs
    from pagedserve.request import Request, Sequence

_PROMPT_CONTEXT = 4


class IncrementalDetokenizer:
    def __init__(self, backend_tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool,
                 stop_strings: list[str], include_stop_str_in_output: bool) -> None:
        self.tokenizer = backend_tokenizer
        self.stream = DecodeStream(ids=prompt_token_ids[-_PROMPT_CONTEXT:], skip_special_tokens=skip_special_tokens)
        self.text = ""
        self.num_tokens = 0                     # output tokens taken in so far
        self.stop_strings = stop_strings
        self.include_stop = include_stop_str_in_output
        # While generating, the last few characters could be the start of a stop string,
        # so they are not shown yet.
        self.holdback = 0 if include_stop_str_in_output else max((len(s) for s in stop_strings), default=1) - 1

    def add_token(self, token_id: int, check_stop: bool) -> str | None:
        """Append a token's text; returns the stop string if one now appears."""
        self.num_tokens += 1
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


class OutputText:
    """Each sequence's text and stop strings, and the logprob entries' token text, for one
    engine (on its thread, with its tokenizer)."""

    def __init__(self, tokenizer: Any) -> None:
        self._backend = tokenizer.backend_tokenizer
        # A token's own text, as vLLM's logprobs show it (and the server's logprobs use it).
        self.token_text = lru_cache(maxsize=1 << 16)(lambda token: tokenizer.decode([token]))

    def start(self, req: Request) -> None:
        """A new request's first sequence gets its detokenizer (beam search has no running text:
        its hypotheses are decoded whole at the end)."""
        if isinstance(req.params, SamplingParams):
            seq = req.seqs[0]
            seq.detokenizer = self._detokenizer(req.params, seq)

    def update(self, req: Request) -> list[tuple[Sequence, str]]:
        """Take in the tokens the step appended to the request's sequences. Returns the live
        sequences a stop string has just ended, with the string: the caller has the scheduler
        finish them. A sequence the scheduler forked gets its own detokenizer here, caught up
        from the prompt."""
        p = req.params
        if not isinstance(p, SamplingParams):
            return []
        stopped = []
        for seq in req.seqs:
            detok = seq.detokenizer
            if detok is None:
                detok = seq.detokenizer = self._detokenizer(p, seq)
            n_prompt, total = seq.num_prompt_tokens, seq.num_output_tokens
            while detok.num_tokens < total:
                k = detok.num_tokens
                if seq.logprobs is not None and k < len(seq.logprobs):
                    self._name_tokens(seq.logprobs[k])
                stop = detok.add_token(seq.token_ids[n_prompt + k], check_stop=k + 1 >= p.min_tokens)
                if stop is None:
                    continue
                # Speculative decoding may have appended tokens after this one in the same step:
                # plain decoding would have stopped here, so they go.
                dropped = total - (k + 1)
                if dropped:
                    self._drop_tail(seq, dropped)
                # A stop string outranks the length limit, never an EOS or stop token id (of the
                # same token: a later token's is dropped with it).
                if not seq.finished:
                    stopped.append((seq, stop))
                elif seq.finish_reason == "length" or dropped:
                    seq.finish_reason, seq.stop_reason = "stop", stop
                detok.num_tokens = k + 1   # nothing after a stop string is text
                break
        if req.prompt_logprobs:
            self._name_prompt_tokens(req.prompt_logprobs)
        return stopped

    @staticmethod
    def _drop_tail(seq: Sequence, n: int) -> None:
        """Remove the last n output tokens (and their logprobs from the running sum)."""
        del seq.token_ids[-n:]
        if seq.logprobs is not None:
            for entry in seq.logprobs[-n:]:
                seq.cumulative_logprob -= next(iter(entry.values())).logprob   # the sampled token's is first
            del seq.logprobs[-n:]

    @staticmethod
    def visible_text(seq: Sequence) -> str:
        return seq.detokenizer.visible_text(seq.finished) if seq.detokenizer is not None else ""

    def _detokenizer(self, p: SamplingParams, seq: Sequence) -> IncrementalDetokenizer:
        n = seq.num_prompt_tokens
        return IncrementalDetokenizer(self._backend, seq.token_ids[max(0, n - _PROMPT_CONTEXT):n],
                                      p.skip_special_tokens, p.stop_strings, p.include_stop_str_in_output)

    def _name_tokens(self, position: PositionLogprobs) -> None:
        for token, lp in position.items():
            lp.decoded_token = self.token_text(token)

    def _name_prompt_tokens(self, positions: list[PositionLogprobs | None]) -> None:
        """The entries recorded since the last step (the newest ones without text)."""
        i = len(positions) - 1
        while i >= 0 and positions[i] and next(iter(positions[i].values())).decoded_token is None:
            self._name_tokens(positions[i])
            i -= 1
