"""sampling/sampler.py on its own: each logits processor and the sampling rules against values
computed here by hand (torch's log_softmax is the only shared piece)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from pagedserve.batch import SamplingSettings
from pagedserve.sampling.sampler import Sampler, SamplingRow

EOS = 7
V = 8


def row(num_output_tokens: int = 0, output=None, prompt=None, generator=None, **settings) -> SamplingRow:
    return SamplingRow(SamplingSettings(**settings), num_output_tokens, output, prompt, generator)


def logits_of(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


BASE = [0.0, 1.0, 3.0, 2.0, -1.0, 0.5, -2.0, 2.5]   # argmax 2, then 7 (EOS), then 3


def sample(rows, *logit_rows, **kw):
    return Sampler({EOS})(logits_of(*logit_rows), rows, **kw)


def test_greedy_takes_the_argmax_and_reports_the_raw_logprobs_ranks_and_top_k():
    out = sample([row(num_logprobs=3, needs_logprob=True, logit_bias={3: 5.0})], BASE)
    assert out.token_ids == [3]                                      # the bias moved the choice ...
    raw = torch.log_softmax(logits_of(BASE), dim=-1)[0]
    assert out.logprobs[0] == pytest.approx(raw[3].item())            # ... not the logprobs
    assert out.ranks == [3]                                          # 3 is third in the raw distribution
    assert out.top_ids == [[2, 7, 3]]
    assert out.top_logprobs[0] == pytest.approx(raw[[2, 7, 3]].tolist())


def test_no_logprobs_asked_none_returned():
    out = sample([row(), row()], BASE, BASE[::-1])
    assert out.token_ids == [2, V - 1 - 2] and out.logprobs is None and out.top_ids is None


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    up = list(BASE)
    up[EOS] = 9.0          # EOS first, stop id 2 second, then 3
    banned = sample([row(num_output_tokens=1, min_tokens=2, stop_token_ids=(2,))], up)
    assert banned.token_ids == [3]
    assert sample([row(num_output_tokens=2, min_tokens=2, stop_token_ids=(2,))], up).token_ids == [EOS]
    # ignore_eos: EOS is not a stop, so min_tokens leaves it alone (the stop id stays banned).
    assert sample([row(num_output_tokens=0, min_tokens=2, stop_token_ids=(2,), ignore_eos=True)], up).token_ids == [EOS]


def test_allowed_token_ids_and_bad_words():
    assert sample([row(allowed_token_ids=(0, 4, 5))], BASE).token_ids == [5]
    assert sample([row(bad_words=((2,),))], BASE).token_ids == [EOS]            # one-token word: always banned
    two = ((6, 2),)    # token 2 is banned only right after a 6
    assert sample([row(output=[1, 6], bad_words=two)], BASE).token_ids == [EOS]
    assert sample([row(output=[6, 1], bad_words=two)], BASE).token_ids == [2]


def test_penalties_follow_their_formulas():
    logits = [2.0, -1.0, 1.9, 0.0, 0.0, 0.0, 0.0, 0.0]
    # Repetition 2: seen token 0 (prompt) 2.0 -> 1.0, so 2 (1.9) wins; a seen negative is multiplied.
    out = Sampler({EOS})(lg := logits_of(logits), [row(output=[1], prompt=[0], repetition_penalty=2.0)])
    assert out.token_ids == [2] and lg[0, 0].item() == pytest.approx(1.0) and lg[0, 1].item() == pytest.approx(-2.0)
    # Frequency 0.1 per occurrence, presence 0.5 once: token 0 seen twice: 2.0 - 0.2 - 0.5 = 1.3.
    out = Sampler({EOS})(lg := logits_of(logits), [row(output=[0, 0], frequency_penalty=0.1, presence_penalty=0.5)])
    assert out.token_ids == [2] and lg[0, 0].item() == pytest.approx(1.3)


def test_truncation_leaves_only_the_allowed_tokens_to_sample():
    gen = torch.Generator().manual_seed(0)
    sampler = Sampler({EOS}, seed=1)
    for settings, allowed in ((dict(top_k=2), {2, 7}), (dict(top_p=0.3), {2}), (dict(min_p=0.3), {2, 7, 3})):
        seen = set()
        for _ in range(200):
            seen |= set(sampler(logits_of(BASE), [row(temperature=1.0, generator=gen, **settings)]).token_ids)
        assert seen == allowed, settings


def test_sampling_follows_the_distribution():
    """temperature 1: the frequencies of 4000 draws are the softmax's, within a few standard errors."""
    sampler = Sampler({EOS}, seed=3)
    logits = logits_of(*[BASE] * 4000)
    counts = np.bincount(sampler(logits, [row(temperature=1.0)] * 4000).token_ids, minlength=V)
    p = torch.softmax(logits_of(BASE), dim=-1)[0].numpy()
    assert np.all(np.abs(counts / 4000 - p) < 4 * np.sqrt(p * (1 - p) / 4000) + 1e-3)


def test_a_seeded_row_draws_the_same_tokens_whatever_else_is_in_the_batch():
    def draws(batch_rows: int) -> list[int]:
        gen = torch.Generator().manual_seed(42)
        sampler, out = Sampler({EOS}, seed=batch_rows), []
        for _ in range(20):
            rows = [row(temperature=1.0)] * batch_rows + [row(temperature=1.0, generator=gen)]
            out.append(sampler(logits_of(*[BASE] * (batch_rows + 1)), rows).token_ids[-1])
        return out
    assert draws(0) == draws(3)
    assert len(set(draws(0))) > 1   # it does sample


def test_the_grammar_bitmask_keeps_only_its_tokens_on_its_rows():
    mask = np.array([[(1 << 0) | (1 << 4)]], dtype=np.int32)   # row 1 may take tokens 0 and 4 only
    out = sample([row(), row()], BASE, BASE, grammar_rows=[1], grammar_bitmask=mask)
    assert out.token_ids == [2, 0]
