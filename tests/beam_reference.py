"""Textbook beam search over transformers' forward: the oracle for the engine's beam search.

Written from the definition, independently of pagedserve: at every step each live
beam is extended by every vocabulary token and the `width` candidates with the
highest cumulative log-prob survive; a surviving candidate that ends in EOS (unless
ignore_eos) leaves the live set as a finished hypothesis; beams still live after
max_tokens are finished too. Hypotheses are ranked by
cum_logprob / len ** length_penalty, len counting prompt and generated tokens but
not a final EOS (vLLM's rule), and the best `width` are returned.

The live beams (of all prompts of one length) are the rows of one batch of
transformers' forward with its own KV cache, whose rows are re-selected
(index_select) to follow the surviving parents each step.
"""
from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from pagedserve import BeamSearchParams


@contextmanager
def torch_threads(n: int | None):
    """Tiny models run fastest on one thread (more only add synchronisation)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n or before)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def beam_score(tokens: list[int], cum_logprob: float, eos: int, length_penalty: float) -> float:
    length = len(tokens) - (1 if tokens[-1] == eos else 0)
    return cum_logprob / length ** length_penalty


@torch.no_grad()
def reference_beam_search(hf, prompts: list[list[int]], width: int, max_tokens: int, eos: int,
                          ignore_eos: bool = False, length_penalty: float = 1.0, num_threads: int | None = None
                          ) -> list[tuple[list[tuple[list[int], float]], float]]:
    """For each prompt: the best `width` hypotheses (prompt + generated tokens, cum_logprob),
    best first, and the smallest score gap between the last surviving and the first dropped
    candidate over all steps (how close the search came to a tie). Prompts of equal length
    search together, their live beams as the rows of one batch."""
    results: dict[int, tuple] = {}
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    with torch_threads(num_threads):
        for group in by_len.values():
            found = _search_together(hf, [prompts[i] for i in group], width, max_tokens, eos, ignore_eos)
            for i, (hyps, gap) in zip(group, found):
                hyps.sort(key=lambda h: -beam_score(h[0], h[1], eos, length_penalty))
                results[i] = (hyps[:width], gap)
    return [results[i] for i in range(len(prompts))]


def _search_together(hf, prompts: list[list[int]], width: int, max_tokens: int, eos: int, ignore_eos: bool):
    out = hf(torch.tensor(prompts), use_cache=True)
    live: list[list[tuple[list[int], float]]] = [[(list(p), 0.0)] for p in prompts]   # per prompt
    finished: list[list[tuple[list[int], float]]] = [[] for _ in prompts]
    gaps = [float("inf")] * len(prompts)
    all_rows = torch.log_softmax(out.logits[:, -1].float(), dim=-1).double()
    for step in range(max_tokens):
        parents = []                 # batch row of each new live beam's parent
        first_row = 0
        for i, beams in enumerate(live):
            rows = all_rows[first_row:first_row + len(beams)]
            cums = torch.tensor([cum for _, cum in beams], dtype=torch.float64)
            scores = (cums[:, None] + rows).flatten()   # float64: the same sums as Python floats
            top = scores.topk(min(width + 1, scores.numel()))
            if scores.numel() > width:
                gaps[i] = min(gaps[i], (top.values[width - 1] - top.values[width]).item())
            new_live = []
            for score, idx in zip(top.values[:width].tolist(), top.indices[:width].tolist()):
                b, tok = divmod(idx, rows.shape[1])
                beam = (beams[b][0] + [tok], score)
                if tok == eos and not ignore_eos:
                    finished[i].append(beam)
                else:
                    new_live.append(beam)
                    parents.append(first_row + b)
            first_row += len(beams)
            live[i] = new_live
        if not parents or step == max_tokens - 1:
            break
        cache = out.cache
        cache.reorder_cache(torch.tensor(parents))
        out = hf(torch.tensor([[t[-1]] for beams in live for t, _ in beams]), cache=cache, use_cache=True)
        all_rows = torch.log_softmax(out.logits[:, -1].float(), dim=-1).double()
    return [(finished[i] + live[i], gaps[i]) for i in range(len(prompts))]


def check_beam_search(llm, hf, prompts: list[list[int]], eos: int, max_tokens: int, widths=(2, 4),
                      num_threads: int | None = 1) -> list[list[int]]:
    """Our beam search equals the reference, token for token, at every width and with and
    without ignore_eos. Returns every hypothesis seen (to check what was exercised)."""
    seen = []
    for width in widths:
        for ignore_eos in (False, True):
            params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, ignore_eos=ignore_eos)
            outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
            refs = reference_beam_search(hf, prompts, width, max_tokens, eos, ignore_eos, num_threads=num_threads)
            for p, out, (ref, gap) in zip(prompts, outs, refs):
                ctx = f"width {width} ignore_eos {ignore_eos} prompt {p} (closest tie {gap:.2e})"
                assert [s.tokens for s in out.sequences] == [t for t, _ in ref], ctx
                assert [s.cum_logprob for s in out.sequences] == pytest.approx([c for _, c in ref], abs=1e-4), ctx
                seen += [s.tokens[len(p):] for s in out.sequences]
    return seen
