"""The seeded workloads moved to pagedserve/bench/datasets.py (`pagedserve bench`); the paper's
reproduction scripts import them from here."""
from pagedserve.bench.datasets import *  # noqa: F401,F403
from pagedserve.bench.datasets import (  # noqa: F401 (named: what the scripts import)
    WORKLOADS, TraceRequest, chatbot_lengths, lognormal_lengths, make_trace, poisson_arrivals, trace_lengths,
    trace_stats)
