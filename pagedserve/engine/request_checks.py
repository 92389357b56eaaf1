"""The checks of one request that need only the engine's sizes, never its state.

LLMEngine runs them on every request it adds (validate_request; the capacity check through
Scheduler.check_request). AsyncLLM runs them on the event loop too when its queue looks full
(check_given), so bad input is answered as bad input (400) whatever the queue's state, never
"retry later" (503) first: the prompt's length and ids, the parameters, and whether the request
could ever run (max_num_seqs, the KV cache's size: `fit`, a value). A prompt given as text is
tokenized off the event loop for that (AsyncLLM), after the cheap bound on its characters.
"""
from __future__ import annotations

from dataclasses import dataclass

from pagedserve.errors import InvalidRequestError
from pagedserve.kv.fit import RequestFit
from pagedserve.pooling_params import PoolingParams
from pagedserve.request import check_capacity
from pagedserve.sampling_params import BeamSearchParams, SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    max_model_len: int
    vocab_size: int
    max_logprobs: int
    max_num_seqs: int
    fit: RequestFit        # the KV cache's sizes (kv/fit.py): could a request ever fit


def split_prompt(prompt) -> tuple[str | None, list[int] | None]:
    """A prompt's text and its token ids as given (either may be None; ids win where both are):
    a string, a list of ints, or a dict with prompt_token_ids or prompt. Anything else is refused."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), list(prompt["prompt_token_ids"])
        prompt = prompt.get("prompt")
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return None, list(prompt)
    raise InvalidRequestError(f"a prompt must be a string, a list of token ids or a dict; got "
                              f"{type(prompt).__name__}", "prompt")


def check_runner(params, is_pooling: bool) -> None:
    """A pooling engine (runner pooling) embeds and does not generate; a generating one the reverse."""
    pooling = isinstance(params, PoolingParams)
    if pooling and not is_pooling:
        raise InvalidRequestError("this engine generates: embeddings need runner='pooling' (--runner pooling)",
                                  "model")
    if not pooling and is_pooling:
        raise InvalidRequestError("this engine runs a pooling model (runner='pooling'): it embeds, it does not "
                                  "generate (LLM.embed, /v1/embeddings)", "model")


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


def check_given(ids: list[int], params, limits: RequestLimits) -> None:
    """Every check of a request with these prompt ids that needs no engine state (the engine's
    own order: prompt, parameters, max_tokens, capacity)."""
    if isinstance(params, (SamplingParams, PoolingParams)) and params.truncate_prompt_tokens:
        ids = ids[-params.truncate_prompt_tokens:]
    check_prompt_ids(ids, limits)
    if isinstance(params, PoolingParams):
        max_tokens = 0     # prefill only
    else:
        check_params(params, limits)
        max_tokens = check_max_tokens(ids, params, limits)
    check_capacity(params, len(ids), max_tokens, limits.max_num_seqs, limits.fit)
