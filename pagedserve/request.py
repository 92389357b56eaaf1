"""Request and sequence state.

A request is what a user submitted: one prompt and its parameters. It owns one
or more sequences (n > 1, best_of, beam search); each sequence has its own
tokens and its own block table in the KV cache manager, keyed by seq_id.
Every sequence has a count of computed tokens that catches up with its token
count; the scheduler decides how many of the missing tokens run each step.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from pagedserve.batch import SamplingSettings
from pagedserve.errors import InvalidRequestError
from pagedserve.sampling_params import BeamSearchParams, SamplingParams
from pagedserve.spec_decode.stats import SpecDecodeCounters


def sampling_settings(params: SamplingParams | BeamSearchParams) -> SamplingSettings:
    """The sampler's view of a request's parameters. Beam search ranks candidates by the raw
    logprobs (beam_width of them per beam); its sampled token itself is unused."""
    if isinstance(params, BeamSearchParams):
        return SamplingSettings(temperature=0.0, ignore_eos=True, num_logprobs=params.beam_width,
                                needs_logprob=True)
    p = params
    return SamplingSettings(p.temperature, p.top_p, p.top_k, p.min_p, p.presence_penalty, p.frequency_penalty,
                            p.repetition_penalty, p.logit_bias or None, p.min_tokens, tuple(p.stop_token_ids or ()),
                            p.ignore_eos, p.logprobs or 0, p.needs_logprobs,
                            tuple(p.allowed_token_ids) if p.allowed_token_ids is not None else None,
                            tuple(tuple(w) for w in p.bad_words_token_ids))


def max_seqs_of(params: Any) -> int:
    """Sequences a request of these parameters can have live at once (its claim on max_num_seqs).
    (PoolingParams have n = best_of = 1.)"""
    return params.beam_width if isinstance(params, BeamSearchParams) else params.best_of


def check_num_seqs(params: Any, max_num_seqs: int) -> None:
    """A request's sequences run together (Request.max_seqs), so more than max_num_seqs could
    never be admitted (and would block the queue): InvalidRequestError naming n or best_of."""
    num = max_seqs_of(params)
    param = "best_of" if not isinstance(params, BeamSearchParams) and params.best_of > params.n else "n"
    if num > max_num_seqs:
        raise InvalidRequestError(
            f"{param} is {num}, but the engine runs at most max_num_seqs={max_num_seqs} sequences at once "
            f"(--max-num-seqs on the server)", param)


def check_capacity(params: Any, prompt_len: int, max_tokens: int, max_num_seqs: int, fit: Any) -> None:
    """Could a request ever run, even alone: no more sequences than max_num_seqs, and room in
    the KV cache at its largest (`fit`: the cache's kv/fit.py value). Sizes only, no state: the
    scheduler's check (Scheduler.check_request), and the event loop's when its queue looks full."""
    check_num_seqs(params, max_num_seqs)
    seqs = max_seqs_of(params)
    fit.check(prompt_len, max_tokens, seqs, seqs > 1 or isinstance(params, BeamSearchParams))


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int
    index: int                               # position in the request's outputs
    token_ids: list[int]                     # prompt + generated
    num_prompt_tokens: int
    num_computed_tokens: int = 0
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, Any]] | None = None
    finish_reason: str | None = None         # "stop" | "length" | "abort"
    stop_reason: int | str | None = None     # the stop token id or stop string that fired
    detokenizer: Any = None                  # its text: the engine's output side (engine/detokenizer.py)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams | BeamSearchParams
    max_tokens: int                           # resolved against max_model_len
    arrival_time: float = field(default_factory=time.monotonic)
    seqs: list[Sequence] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    prompt_logprobs: list[dict[int, Any] | None] | None = None
    # Prefix-cache blocks are shared only between requests with the same salt (None: unsalted).
    cache_salt: str | None = None
    # Set while a parallel-sampling request still has to split into best_of sequences.
    pending_fork: bool = False
    # Set when a multi-sequence request was preempted by recompute: its first sequence
    # recomputes the shared prompt alone, then the others take those blocks back by
    # reference (as after the original fork) and recompute only their own tokens.
    rejoin: bool = False
    # Timestamps for metrics.
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0                # prompt tokens served from the prefix cache
    sampling: SamplingSettings | None = None  # the sampler's view of params (set by create)
    # Structured outputs: the grammar's compile and each sequence's matcher (structured/manager.py).
    structured: Any = None
    # A pooling request (PoolingParams): its pooling type (LAST, MEAN, CLS) and what the chunks
    # computed so far pooled (a float32 vector; MEAN: the sum of the rows).
    pooling: str | None = None
    pooled: Any = None
    # Speculative decoding: this request's drafts and how many were accepted (spec_decode/stats.py).
    spec: SpecDecodeCounters = field(default_factory=SpecDecodeCounters)
    # Multi-LoRA: its adapter (lora/request.py LoRARequest, lora_path resolved to a checked local
    # directory; None: the base model), and the slot it holds while admitted (-1: none).
    lora: Any = None
    lora_slot: int = -1

    @classmethod
    def create(cls, request_id: str, prompt: str | None, prompt_token_ids: list[int],
               params: SamplingParams | BeamSearchParams | Any, max_tokens: int, seq_id: int, *,
               arrival_time: float | None = None, cache_salt: str | None = None,
               structured: Any = None, pooling: str | None = None, lora: Any = None) -> "Request":
        """The one way a request is made (the engine, the simulators and tests call it): its
        first sequence (`seq_id`, from the scheduler's new_seq_id), the pending fork of a
        parallel-sampling request, the sampler's settings, the prompt-logprobs record and its
        grammar state (`structured`, from GrammarCompiler.new_state), all before it is queued.
        A pooling request (`pooling`: its pooling type) has no sampler settings."""
        ids = list(prompt_token_ids)
        req = cls(request_id, prompt, ids, params, max_tokens, cache_salt=cache_salt, structured=structured,
                  sampling=sampling_settings(params) if pooling is None else None, pooling=pooling, lora=lora)
        if arrival_time is not None:
            req.arrival_time = arrival_time
        seq = Sequence(seq_id, 0, list(ids), len(ids))
        if isinstance(params, SamplingParams):
            if params.logprobs is not None:
                seq.logprobs = []
            req.pending_fork = params.best_of > 1
            if params.prompt_logprobs is not None:
                req.prompt_logprobs = [None]
        req.seqs.append(seq)
        return req

    @property
    def lora_name(self) -> str | None:
        """Its adapter's name (None: the base model)."""
        return None if self.lora is None else self.lora.lora_name

    @property
    def lora_key(self) -> str | None:
        """Its adapter's cache key (id and content; None: the base model): part of its
        prefix-cache keys (kv_salt)."""
        return None if self.lora is None else self.lora.cache_key

    @property
    def waiting_for_grammar(self) -> bool:
        """Its grammar is still compiling: the scheduler admits it only once it is ready."""
        return self.structured is not None and not self.structured.ready

    @property
    def is_beam_search(self) -> bool:
        return isinstance(self.params, BeamSearchParams)

    @property
    def max_seqs(self) -> int:
        """Sequences this request can have live at once (its claim on max_num_seqs)."""
        return max_seqs_of(self.params)

    @property
    def leader_only(self) -> bool:
        """Only the first live sequence runs, until it has computed the shared prompt."""
        return self.pending_fork or self.rejoin

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs need every prompt position computed, so no prefix-cache hits."""
        return self.prompt_logprobs is not None

    @property
    def computes_every_prompt_token(self) -> bool:
        """No prefix-cache hits: prompt logprobs and MEAN or CLS pooling read every position's
        (or the first's) hidden state; LAST pooling reads the last token's, which a prefix hit
        never covers (lookup_block_keys)."""
        return self.wants_prompt_logprobs or self.pooling in ("MEAN", "CLS")

    @property
    def live_seqs(self) -> list[Sequence]:
        return [s for s in self.seqs if not s.finished]

    @property
    def finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def fork_seq(self, parent: Sequence, seq_id: int, index: int) -> Sequence:
        """A new sequence that continues from where `parent` is (its blocks are shared by
        the KV cache manager)."""
        child = Sequence(
            seq_id=seq_id,
            index=index,
            token_ids=list(parent.token_ids),
            num_prompt_tokens=parent.num_prompt_tokens,
            num_computed_tokens=parent.num_computed_tokens,
            cumulative_logprob=parent.cumulative_logprob,
            logprobs=None if parent.logprobs is None else list(parent.logprobs),
        )   # its text is the engine's output side's (engine/detokenizer.py): made there
        self.seqs.append(child)
        return child
