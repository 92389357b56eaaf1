"""Seeded synthetic workloads with the paper's length statistics.

The vLLM paper's traces: ShareGPT (mean 161 input / 338 output tokens, long
tailed) and Alpaca (mean 19 / 58). Lengths are drawn from a lognormal with that
mean, clipped to the model's context; token ids are random (EOS is ignored, so
each request produces exactly its traced output length).
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

WORKLOADS = {
    # name: (mean input, mean output)
    "sharegpt": (161, 338),
    "alpaca": (19, 58),
}


@dataclass
class TraceRequest:
    prompt_token_ids: list[int]
    output_len: int
    arrival_time: float = 0.0     # seconds after the start of the run


def lognormal_lengths(rng: random.Random, n: int, mean: float, sigma: float, lo: int, hi: int) -> list[int]:
    mu = math.log(mean) - sigma * sigma / 2     # makes the lognormal's mean equal `mean`
    return [max(lo, min(hi, round(rng.lognormvariate(mu, sigma)))) for _ in range(n)]


def make_trace(name: str, num_requests: int, seed: int = 0, vocab_size: int = 49152, max_model_len: int = 2048,
               request_rate: float = math.inf, sigma: float = 0.8) -> list[TraceRequest]:
    """`request_rate` requests/s with Poisson arrivals (inf: all at t=0). Token ids skip the
    first 100 ids, where tokenizers keep their special tokens."""
    mean_in, mean_out = WORKLOADS[name]
    rng = random.Random(seed)
    ins = lognormal_lengths(rng, num_requests, mean_in, sigma, 4, max_model_len // 2)
    outs = lognormal_lengths(rng, num_requests, mean_out, sigma, 4, max_model_len // 2)
    t = 0.0
    trace = []
    for n_in, n_out in zip(ins, outs):
        ids = [rng.randrange(100, vocab_size) for _ in range(n_in)]
        if request_rate != math.inf:
            t += rng.expovariate(request_rate)
        trace.append(TraceRequest(ids, min(n_out, max_model_len - n_in), t))
    return trace
