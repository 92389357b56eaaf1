"""Prompt lookup (n-gram) drafts: the tokens that followed the most recent earlier occurrence
of the sequence's last n tokens (prompt and output alike), n from prompt_lookup_max down to
prompt_lookup_min. Runs on the scheduler's side, on token ids; no model."""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose(token_ids: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k draft tokens to follow token_ids (empty: no earlier match)."""
    L = len(token_ids)
    if k <= 0 or L < n_min + 1:
        return []
    arr = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        suffix = arr[L - n:]
        # Windows starting at 0 .. L-n-1: every occurrence but the suffix itself.
        windows = sliding_window_view(arr[:L - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return arr[start:start + k].tolist()
    return []
