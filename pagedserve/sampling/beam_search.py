"""Textbook beam search, one step at a time.

Every live beam is extended by every vocabulary token; the `beam_width`
candidates with the highest cumulative log-prob survive. A candidate ending in
any of the model's EOS ids (unless ignore_eos) leaves the live set as a finished hypothesis. Only each
beam's top `beam_width` tokens can be among the overall top `beam_width`, so
those are all the sampler reports.
"""
from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass


@dataclass
class Candidate:
    parent: int          # index of the beam it extends
    token_id: int
    logprob: float
    cum_logprob: float


def select_candidates(cum_logprobs: list[float], top_ids: list[list[int]], top_logprobs: list[list[float]],
                      beam_width: int) -> list[Candidate]:
    """The beam_width best extensions of the live beams, best first (ties: earlier beam,
    then more likely token)."""
    cands = [Candidate(b, tok, lp, cum + lp)
             for b, (cum, ids, lps) in enumerate(zip(cum_logprobs, top_ids, top_logprobs))
             for tok, lp in zip(ids, lps)]
    cands.sort(key=lambda c: -c.cum_logprob)   # stable: keeps the tie order
    return cands[:beam_width]


def beam_score(tokens: list[int], cum_logprob: float, eos_token_ids: Collection[int] | int | None,
               length_penalty: float) -> float:
    """vLLM's ranking of finished hypotheses, cum_logprob / len ** length_penalty (len counting
    prompt and generated tokens but not a final EOS), as a key that orders hypotheses the same
    way, computed in log space: len ** length_penalty overflows (or underflows to 0) for large
    |length_penalty|. cum_logprob <= 0, so the score is -exp(log(-cum_logprob) - length_penalty *
    log(len)), which orders like -(log(-cum_logprob) - length_penalty * log(len)): finite for any
    finite length_penalty, +inf for a hypothesis of probability 1."""
    eos = eos_token_ids if isinstance(eos_token_ids, Collection) else (eos_token_ids,)
    length = len(tokens) - (1 if tokens and tokens[-1] in eos else 0)
    magnitude = -min(cum_logprob, 0.0)
    if magnitude == 0.0:
        return math.inf
    return length_penalty * math.log(max(length, 1)) - math.log(magnitude)
