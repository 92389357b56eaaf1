"""The checks of one request that need only the engine's sizes, never its state.

LLMEngine runs them on every request it adds (validate_request). AsyncLLM runs them on the
event loop too when its queue looks full, on prompts given as token ids (the server's), so
bad input is answered as bad input (400) whatever the queue's state, never "retry later" (503)
first. What needs the engine's tokenizer (text prompts, bad_words) or the KV cache's size
(Scheduler.check_request's other half) is checked on the engine thread, also before the queue's room.
"""
from __future__ import annotations

from dataclasses import dataclass

from pagedserve.errors import InvalidRequestError
from pagedserve.pooling_params import PoolingParams
from pagedserve.request import check_num_seqs
from pagedserve.sampling_params import BeamSearchParams, SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    max_model_len: int
    vocab_size: int
    max_logprobs: int
    max_num_seqs: int


def given_prompt_ids(prompt) -> list[int] | None:
    """A prompt's token ids if it comes with them (a dict's prompt_token_ids, a list of ints);
    None for text, which only the engine tokenizes."""
    if isinstance(prompt, dict):
        prompt = prompt.get("prompt_token_ids")
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return prompt
    return None


def check_prompt_ids(ids: list[int], limits: RequestLimits) -> None:
    if not ids:
        raise InvalidRequestError("the prompt is empty: give at least one token", "prompt")
    if len(ids) >= limits.max_model_len:
        raise InvalidRequestError(
            f"the prompt is {len(ids)} tokens long; this model's maximum context length is "
            f"{limits.max_model_len} tokens, which must also hold at least one generated token", "prompt",
            "context_length_exceeded")
    bad = [t for t in ids if not 0 <= t < limits.vocab_size]
    if bad:
        raise InvalidRequestError(f"token ids out of vocabulary (size {limits.vocab_size}): {bad[:5]}", "prompt")


def check_params(params: SamplingParams | BeamSearchParams, limits: RequestLimits) -> None:
    """Token ids in the parameters index the logits: one outside the vocabulary would fail
    the whole step, so it is refused here; so are more logprobs than max_logprobs."""
    if not isinstance(params, SamplingParams):
        return
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and value > limits.max_logprobs:
            raise InvalidRequestError(f"{name} ({value}) is more than this engine's max_logprobs "
                                      f"({limits.max_logprobs})", name)
    for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or ()),
                      ("allowed_token_ids", params.allowed_token_ids or ())):
        bad = [t for t in ids if not 0 <= t < limits.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"{name} has token ids out of vocabulary (size {limits.vocab_size}): {bad[:5]}", name)


def check_max_tokens(ids: list[int], params: SamplingParams | BeamSearchParams, limits: RequestLimits) -> int:
    """The request's max_tokens: the requested number (None: no limit) cut to what the context
    holds after the prompt. The one place max_tokens is resolved."""
    room = limits.max_model_len - len(ids)
    max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
    if isinstance(params, SamplingParams) and params.min_tokens > max_tokens:
        raise InvalidRequestError(f"min_tokens ({params.min_tokens}) must be <= max_tokens ({max_tokens})",
                                  "min_tokens")
    return max_tokens


def check_given(prompt, params, limits: RequestLimits) -> None:
    """What can be checked of a request without the engine (its prompt only if given as ids)."""
    check_num_seqs(params, limits.max_num_seqs)
    ids = given_prompt_ids(prompt)
    if ids is not None:
        if isinstance(params, (SamplingParams, PoolingParams)) and params.truncate_prompt_tokens:
            ids = ids[-params.truncate_prompt_tokens:]
        check_prompt_ids(ids, limits)
    if isinstance(params, PoolingParams):
        return
    check_params(params, limits)
    if ids is not None:
        check_max_tokens(ids, params, limits)
