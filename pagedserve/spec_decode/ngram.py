"""Prompt lookup (n-gram) drafts: the tokens that followed the most recent earlier occurrence
of the sequence's last n tokens (prompt and output alike), n from prompt_lookup_max down to
prompt_lookup_min. Runs on the scheduler's side, on token ids; no model."""
from __future__ import annotations

import numpy as np


def propose(token_ids: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k draft tokens to follow token_ids (empty: no earlier match)."""
    L = len(token_ids)
    if k <= 0 or L < n_min + 1:
        return []
    arr = np.asarray(token_ids, dtype=np.int64)
    # Where the last token occurred before (an occurrence's last index), then, one token back
    # at a time, those where the n-gram goes on matching: one pass over the sequence.
    ends = np.flatnonzero(arr[:L - 1] == arr[-1])
    n_top = min(n_max, L - 1)
    match = {1: ends}
    for n in range(2, n_top + 1):
        ends = ends[ends >= n - 1]
        ends = ends[arr[ends - (n - 1)] == arr[L - n]]
        match[n] = ends
        if not ends.size:
            break
    for n in range(n_top, n_min - 1, -1):
        hits = match.get(n)
        if hits is not None and hits.size:
            start = int(hits[-1]) + 1
            return arr[start:start + k].tolist()
    return []
