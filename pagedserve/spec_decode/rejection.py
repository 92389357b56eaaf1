"""Verifying draft tokens against the target model's logits, exactly.

A sequence with k drafts d_1..d_k has 1 + k rows of logits: row j is the target's next-token
distribution after the sequence's tokens and d_1..d_j. Each row is processed as plain decoding
would process it at that point (the sampler's logit bias, min_tokens, allowed tokens, bad words
and penalties, with d_1..d_j counted as output), so:
- greedy: d_j is accepted while it is row j-1's argmax; the first row whose argmax differs (or
  row k, after all are accepted) gives one more token. The tokens are exactly plain decoding's.
- sampled: row j's distribution p_j after temperature, min_p, top-k and top-p. An n-gram draft
  is a point mass q (q(d) = 1), so d is accepted with probability min(1, p(d) / q(d)) = p(d);
  on rejection the token is drawn from the normalised residual max(0, p - q), i.e. p with d
  removed. Each emitted token then follows p exactly (speculative sampling's theorem). A seeded
  sequence draws its uniforms and noise from its own generator: reproducible per seed.
Logprobs are those of the raw rows, as plain decoding reports them.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from pagedserve.batch import SamplerOutput
from pagedserve.sampling.sampler import Sampler, SamplingRow, seeded_noise


@dataclass
class DraftRow:
    """One sequence's verification inputs: its sampling row (as for plain decoding at the first
    position) and its drafts."""
    row: SamplingRow
    draft_token_ids: list[int]


def position_rows(d: DraftRow) -> list[SamplingRow]:
    """The sampling rows of the 1 + k positions: row j counts drafts 1..j as output."""
    r = d.row
    rows = []
    for j in range(len(d.draft_token_ids) + 1):
        out = None if r.output_token_ids is None else [*r.output_token_ids, *d.draft_token_ids[:j]]
        rows.append(replace(r, num_output_tokens=r.num_output_tokens + j, output_token_ids=out))
    return rows


def verify(sampler: Sampler, logits: torch.Tensor, drafts: list[DraftRow],
           residual: bool = True) -> list[SamplerOutput]:
    """logits: [sum(1 + k_i), V] float32, each sequence's rows in order (modified in place).
    Returns per sequence the emitted tokens (1 .. k+1) with their logprobs.
    residual=False resamples from p itself on rejection: wrong, for the tests to catch."""
    rows = [r for d in drafts for r in position_rows(d)]
    raw = torch.log_softmax(logits, dim=-1) if any(r.needs_logprob or r.num_logprobs for r in rows) else None
    sampler._apply_bias_and_min_tokens(logits, rows, set())
    sampler._apply_penalties(logits, rows)
    targets = sampler.argmax(logits).tolist() if any(d.row.params.greedy for d in drafts) else None
    outputs = []
    at = 0
    for d in drafts:
        k = len(d.draft_token_ids)
        block = slice(at, at + k + 1)
        if d.row.params.greedy:
            tokens = _accept_greedy(targets[block], d.draft_token_ids)
        else:
            tokens = _accept_sampled(sampler, logits[block], d, residual)
        outputs.append(_logprobs(raw, at, tokens, rows[block]))
        at += k + 1
    return outputs


def _accept_greedy(targets: list[int], drafts: list[int]) -> list[int]:
    a = 0
    while a < len(drafts) and targets[a] == drafts[a]:
        a += 1
    return targets[:a + 1]


def _accept_sampled(sampler: Sampler, logits: torch.Tensor, d: DraftRow, residual: bool) -> list[int]:
    p = d.row.params
    x = logits / p.temperature
    n = x.shape[0]
    x = sampler._truncate(x, sampler._build_random_rows([d.row] * n, list(range(n))))   # min_p, top-k/p per row
    probs = torch.softmax(x, dim=-1)
    gen = d.row.generator if d.row.generator is not None else sampler.generator
    tokens = []
    for j, draft in enumerate(d.draft_token_ids):
        u = torch.rand(1, generator=gen, device=gen.device).item()
        if u < probs[j, draft].item():
            tokens.append(draft)
            continue
        dist = probs[j].clone()
        if residual:
            dist[draft] = 0.0       # max(0, p - q) with q the point mass on the draft
        tokens.append(_draw(dist, d.row, gen))
        return tokens
    tokens.append(_draw(probs[-1], d.row, gen))   # all accepted: the bonus token, from p_k
    return tokens


def _draw(dist: torch.Tensor, row: SamplingRow, gen: torch.Generator) -> int:
    """A token from the (unnormalised) distribution, by the sampler's exponential-noise trick."""
    noise = torch.empty_like(dist)
    if row.generator is not None:
        seeded_noise(noise, row.generator)
    else:
        noise.exponential_(generator=gen)
    return int(torch.argmax(dist / noise).item())


def _logprobs(raw: torch.Tensor | None, at: int, tokens: list[int], rows: list[SamplingRow]) -> SamplerOutput:
    """The emitted tokens' logprobs, as the sampler gathers them for plain decoding."""
    if raw is None:
        return SamplerOutput(tokens, None, None, None, None)
    n = len(tokens)
    return Sampler._gather_logprobs(raw[at:at + n], torch.tensor(tokens, device=raw.device), rows[:n])
