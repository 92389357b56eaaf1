"""Seeded synthetic workloads (`pagedserve bench --dataset-name`): `random` (every prompt exactly
--input-len tokens, every output --output-len) and the paper's length statistics.

The vLLM paper's traces: ShareGPT (mean 161 input / 338 output tokens, long
tailed) and Alpaca (mean 19 / 58). Lengths are drawn from a lognormal with that
mean, clipped to the model's context; token ids are random (EOS is ignored, so
each request produces exactly its traced output length). Arrivals are a Poisson
process at `request_rate` requests/s (inf: all at t=0), drawn from their own
random stream: the same seed gives the same requests at every rate, only spaced
differently. `scale` shrinks every length (the means and the shortest length)
for machines that cannot serve the paper's lengths in reasonable time.
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


def trace_lengths(name: str, num_requests: int, seed: int = 0, max_model_len: int = 2048, sigma: float = 0.8,
                  scale: float = 1.0, rng: random.Random | None = None) -> list[tuple[int, int]]:
    """(input, output) lengths of a trace: each at least 4 * scale tokens (1 at least) and at
    most half the context, and input + output within max_model_len."""
    mean_in, mean_out = WORKLOADS[name]
    rng = rng or random.Random(seed)
    lo, hi = max(1, round(4 * scale)), max(1, max_model_len // 2)
    ins = lognormal_lengths(rng, num_requests, mean_in * scale, sigma, lo, hi)
    outs = lognormal_lengths(rng, num_requests, mean_out * scale, sigma, lo, hi)
    return [(n_in, min(n_out, max_model_len - n_in)) for n_in, n_out in zip(ins, outs)]


def poisson_arrivals(num_requests: int, request_rate: float, seed: int = 0) -> list[float]:
    """Arrival times (s) of a Poisson process at `request_rate` per second (inf: all at 0)."""
    if request_rate <= 0:
        raise ValueError(f"request_rate must be > 0 requests/s; got {request_rate}")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = random.Random(f"{seed}-arrivals")
    t, times = 0.0, []
    for _ in range(num_requests):
        t += rng.expovariate(request_rate)
        times.append(t)
    return times


def make_trace(name: str, num_requests: int, seed: int = 0, vocab_size: int = 49152, max_model_len: int = 2048,
               request_rate: float = math.inf, sigma: float = 0.8, scale: float = 1.0) -> list[TraceRequest]:
    """`request_rate` requests/s with Poisson arrivals (inf: all at t=0). Token ids skip the
    first 100 ids, where tokenizers keep their special tokens."""
    rng = random.Random(seed)
    lengths = trace_lengths(name, num_requests, seed, max_model_len, sigma, scale, rng)
    arrivals = poisson_arrivals(num_requests, request_rate, seed)
    return [TraceRequest([rng.randrange(100, vocab_size) for _ in range(n_in)], n_out, t)
            for (n_in, n_out), t in zip(lengths, arrivals)]


def trace_stats(trace: list[TraceRequest]) -> dict:
    ins = [len(r.prompt_token_ids) for r in trace]
    outs = [r.output_len for r in trace]
    n = max(1, len(trace))
    return {"num_requests": len(trace), "mean_input": sum(ins) / n, "mean_output": sum(outs) / n,
            "max_input": max(ins, default=0), "max_output": max(outs, default=0)}


def chatbot_lengths(num_requests: int, seed: int = 0, history_limit: int = 1024,
                    max_tokens: int = 1024) -> list[tuple[int, int]]:
    """(prompt, answer) lengths of the paper's chatbot workload (Sec. 6.5) made from the
    ShareGPT-like statistics: the prompt is the conversation so far (1-5 earlier rounds of
    question and answer, then the new question), cut to its last `history_limit` tokens; the
    answer is a ShareGPT-like output, at most `max_tokens` (what each request asks for)."""
    rng = random.Random(f"{seed}-chatbot")
    mean_in, mean_out = WORKLOADS["sharegpt"]
    out = []
    for _ in range(num_requests):
        rounds = rng.randint(1, 5)
        questions = lognormal_lengths(rng, rounds + 1, mean_in, 0.8, 4, history_limit)
        answers = lognormal_lengths(rng, rounds + 1, mean_out, 0.8, 4, max_tokens)
        history = sum(questions) + sum(answers[:-1])
        out.append((min(history, history_limit), answers[-1]))
    return out


# `--dataset-name` -> the trace's lengths: random, or the paper's statistics (no text is read:
# the lengths follow the datasets, the token ids are random).
DATASETS = ("random", "sharegpt-like", "alpaca-like")


def random_trace(num_requests: int, input_len: int, output_len: int, seed: int = 0, vocab_size: int = 49152,
                 request_rate: float = math.inf) -> list[TraceRequest]:
    """Every prompt input_len random token ids (from id 100: past most tokenizers' special
    tokens), every output output_len tokens; Poisson arrivals as make_trace's."""
    if input_len < 1 or output_len < 1:
        raise ValueError(f"--input-len and --output-len must be >= 1; got {input_len}, {output_len}")
    rng = random.Random(seed)
    arrivals = poisson_arrivals(num_requests, request_rate, seed)
    first = min(100, vocab_size // 2)
    return [TraceRequest([rng.randrange(first, vocab_size) for _ in range(input_len)], output_len, t)
            for t in arrivals]


def dataset_trace(name: str, num_requests: int, input_len: int, output_len: int, seed: int = 0,
                  vocab_size: int = 49152, max_model_len: int = 2048,
                  request_rate: float = math.inf) -> list[TraceRequest]:
    """The trace `--dataset-name` names (DATASETS)."""
    if name == "random":
        return random_trace(num_requests, input_len, output_len, seed, vocab_size, request_rate)
    if name.removesuffix("-like") in WORKLOADS:
        return make_trace(name.removesuffix("-like"), num_requests, seed, vocab_size, max_model_len, request_rate)
    raise ValueError(f"--dataset-name {name!r}: expected one of {', '.join(DATASETS)}")
