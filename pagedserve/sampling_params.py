"""Sampling parameters, validated at construction with errors that name the value and the limit
(InvalidRequestError, whose `param` is the parameter at fault)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from pagedserve.errors import InvalidRequestError
from pagedserve.structured.params import StructuredOutputsParams
# Beam search's length_penalty: beyond this, len ** length_penalty only ranks by length.
MAX_LENGTH_PENALTY = 100.0


def _check(param: str, ok: bool, message: str) -> None:
    if not ok:
        raise InvalidRequestError(message, param)


class RequestOutputKind(enum.IntEnum):
    """What AsyncLLM.generate yields as a request runs (vLLM's): every output with all the
    tokens so far, only the new tokens of each, or only the final output. LLM.generate
    returns final outputs whatever it is."""
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    n: int = 1
    best_of: int | None = None          # sample best_of sequences, return the n most likely
    temperature: float = 1.0            # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0                      # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    max_tokens: int | None = 16         # None: up to the context length
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None         # top-k logprobs per generated token
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # Constrain the output to a JSON schema, regex, choice or grammar (pagedserve/structured/).
    structured_outputs: StructuredOutputsParams | None = None
    bad_words: list[str] | None = None          # never generate these words (their token sequences)
    allowed_token_ids: list[int] | None = None  # sample only among these tokens
    truncate_prompt_tokens: int | None = None   # keep only the prompt's last k tokens
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # vLLM takes Python callables here; pagedserve's worker gets plain data (batch.py), so they are refused.
    logits_processors: list[Any] | None = None
    stop_strings: list[str] = field(init=False, default_factory=list)
    # bad_words as token id sequences, filled in by the engine's tokenizer (LLMEngine.validate_params)
    bad_words_token_ids: list[list[int]] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        _check("n", isinstance(self.n, int) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}")
        if self.best_of is None:
            self.best_of = self.n
        _check("best_of", isinstance(self.best_of, int) and self.best_of >= self.n,
                          f"best_of must be an integer >= n ({self.n}), got {self.best_of!r}")
        _check("temperature", self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}")
        _check("top_p", 0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == -1:
            self.top_k = 0
        _check("top_k", isinstance(self.top_k, int) and 0 <= self.top_k < 2**63,
                        f"top_k must be 0 or -1 (off) or a positive integer, got {self.top_k!r}")
        _check("min_p", 0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        _check("presence_penalty", -2.0 <= self.presence_penalty <= 2.0,
                                   f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        _check("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0,
                                    f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        _check("repetition_penalty", self.repetition_penalty > 0.0,
                                     f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        _check("max_tokens", self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
                             f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        _check("min_tokens", isinstance(self.min_tokens, int) and self.min_tokens >= 0,
                             f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        _check("min_tokens", self.max_tokens is None or self.min_tokens <= self.max_tokens,
                             f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):   # the upper limit is the engine's max_logprobs
            value = getattr(self, name)
            _check(name, value is None or (isinstance(value, int) and value >= 0),
                         f"{name} must be an integer >= 0, got {value!r}")
        _check("seed", self.seed is None or isinstance(self.seed, int), f"seed must be an integer, got {self.seed!r}")
        if isinstance(self.stop, str):
            self.stop_strings = [self.stop]
        else:
            self.stop_strings = list(self.stop or [])
        _check("stop", all(isinstance(s, str) and s for s in self.stop_strings),
                       f"stop must be non-empty strings, got {self.stop!r}")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            _check("logit_bias", all(-100.0 <= v <= 100.0 for v in self.logit_bias.values()),
                                 "logit_bias values must be in [-100, 100]")
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        _check("structured_outputs", self.structured_outputs is None or
                                     isinstance(self.structured_outputs, StructuredOutputsParams),
                                     f"structured_outputs must be a StructuredOutputsParams, got "
                                     f"{type(self.structured_outputs).__name__}")
        _check("bad_words", self.bad_words is None or all(isinstance(w, str) and w.strip() for w in self.bad_words),
                            f"bad_words must be non-empty strings, got {self.bad_words!r}")
        if self.allowed_token_ids is not None:
            _check("allowed_token_ids", len(self.allowed_token_ids) > 0 and
                                        all(isinstance(t, int) for t in self.allowed_token_ids),
                                        f"allowed_token_ids must be a non-empty list of token ids, got "
                                        f"{self.allowed_token_ids!r}")
        _check("truncate_prompt_tokens", self.truncate_prompt_tokens is None or
                                         (isinstance(self.truncate_prompt_tokens, int) and self.truncate_prompt_tokens >= 1),
                                         f"truncate_prompt_tokens must be an integer >= 1, got "
                                         f"{self.truncate_prompt_tokens!r}")
        self.output_kind = RequestOutputKind(self.output_kind)
        _check("logits_processors", not self.logits_processors,
                                    "logits_processors are not supported (the worker receives plain data, not "
                                    "Python callables); use logit_bias, allowed_token_ids or bad_words")
        if self.greedy:
            # Greedy sampling would give best_of identical copies; vLLM refuses it too.
            _check("best_of", self.best_of == 1 or self.n == self.best_of,
                              f"best_of ({self.best_of}) > n ({self.n}) needs temperature > 0")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def needs_logprobs(self) -> bool:
        """The sampled token's logprob is needed: for logprobs or to rank best_of."""
        return self.logprobs is not None or self.best_of > self.n


@dataclass
class BeamSearchParams:
    beam_width: int
    max_tokens: int | None = 16         # None: up to the context length
    ignore_eos: bool = False
    temperature: float = 0.0            # kept for vLLM compatibility; beam search is deterministic
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        _check("beam_width", isinstance(self.beam_width, int) and self.beam_width >= 1,
                             f"beam_width must be an integer >= 1, got {self.beam_width!r}")
        _check("max_tokens", self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
                             f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        _check("temperature", self.temperature == 0.0, "beam search only supports temperature 0")
        limit = MAX_LENGTH_PENALTY
        _check("length_penalty", isinstance(self.length_penalty, (int, float)) and
                                 -limit <= self.length_penalty <= limit,
                                 f"length_penalty must be a number in [-{limit:g}, {limit:g}], "
                                 f"got {self.length_penalty!r}")
