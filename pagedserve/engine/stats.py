"""What the engine loop reports after each step, and the periodic log line.

The engine thread builds these plain records; stat loggers (this module's
LoggingStatLogger, the server's Prometheus logger) consume them. Loggers are
called on the engine thread, so they must be quick and thread-safe.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

logger = logging.getLogger("pagedserve.engine")


@dataclass
class SchedulerStats:
    """The scheduler and KV cache as they are now (counters are cumulative)."""
    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0                 # requests preempted to swap space
    kv_cache_usage: float = 0.0          # fraction of blocks in use, 0..1
    prefix_cache_queries: int = 0        # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0           # of those, tokens found
    num_preemptions: int = 0
    num_swapped_out_blocks: int = 0
    num_swapped_in_blocks: int = 0
    num_recomputed_tokens: int = 0       # computed tokens thrown away by recompute preemption
    # The prefix cache's disk tier (kv/tier.py): prompt tokens looked up there and found (vLLM's
    # external prefix cache), the blocks it holds, bytes written and read (cumulative).
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    kv_offload_blocks: int = 0
    kv_offload_bytes_written: int = 0
    kv_offload_bytes_read: int = 0
    # A hybrid model's KV groups (kv/groups.py): (group, e.g. "1:sliding_window=1024", device blocks it holds).
    kv_group_blocks: tuple[tuple[str, int], ...] = ()
    # Speculative decoding (spec_decode/stats.py): cumulative, as vLLM's spec_decode counters.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: tuple[int, ...] = ()
    # Multi-LoRA (vLLM's lora_requests_info): requests per adapter name, running and waiting
    # (swapped ones count as running, as they hold their slot); max_lora 0: LoRA is off.
    running_lora_adapters: dict[str, int] = field(default_factory=dict)
    waiting_lora_adapters: dict[str, int] = field(default_factory=dict)
    max_lora: int = 0


@dataclass
class FinishedRequestStats:
    finish_reason: str                   # stop | length | abort
    e2e_latency: float                   # arrival -> finished, seconds
    queue_time: float | None             # arrival -> first scheduled (None: never scheduled)
    num_prompt_tokens: int
    num_generation_tokens: int
    lora_name: str | None = None         # its LoRA adapter (None: the base model)


@dataclass
class IterationStats:
    """What one engine step produced. As in vLLM, a request's prompt tokens count in the
    step that produces its first token."""
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.num_prompt_tokens or self.num_generation_tokens or self.finished)


@dataclass
class StatTotals:
    """Running totals of what the engine reported (a StatLogger), for the dashboard's counters:
    the same sums as the Prometheus counters and histograms, as plain numbers."""
    prompt_tokens: int = 0
    generation_tokens: int = 0
    ttft_sum: float = 0.0                # seconds, over ttft_count first tokens
    ttft_count: int = 0
    itl_sum: float = 0.0                 # seconds, over itl_count gaps between a request's steps
    itl_count: int = 0
    num_finished_requests: int = 0

    def record(self, scheduler: SchedulerStats, iteration: IterationStats | None) -> None:
        if iteration is None:
            return
        self.prompt_tokens += iteration.num_prompt_tokens
        self.generation_tokens += iteration.num_generation_tokens
        self.ttft_sum += sum(iteration.time_to_first_tokens)
        self.ttft_count += len(iteration.time_to_first_tokens)
        self.itl_sum += sum(iteration.inter_token_latencies)
        self.itl_count += len(iteration.inter_token_latencies)
        self.num_finished_requests += len(iteration.finished)


class StatLogger(Protocol):
    def record(self, scheduler: SchedulerStats, iteration: IterationStats | None) -> None: ...


class LoggingStatLogger:
    """Logs one line every `interval` seconds while there is activity (and one idle line after)."""

    def __init__(self, interval: float = 10.0) -> None:
        self.interval = interval
        self._last_log = time.monotonic()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._queries_at_last = 0
        self._hits_at_last = 0
        self._last: SchedulerStats = SchedulerStats()
        self._was_active = False
        self._spec_at_last = (0, 0, 0)   # drafts, draft tokens, accepted tokens at the last log

    def record(self, scheduler: SchedulerStats, iteration: IterationStats | None) -> None:
        self._last = scheduler
        if iteration is not None:
            self._prompt_tokens += iteration.num_prompt_tokens
            self._generation_tokens += iteration.num_generation_tokens

    def restart_clock(self) -> None:
        self._last_log = time.monotonic()

    def seconds_until_due(self) -> float:
        return max(0.0, self._last_log + self.interval - time.monotonic())

    def maybe_log(self) -> None:
        now = time.monotonic()
        elapsed = now - self._last_log
        if elapsed < self.interval:
            return
        s = self._last
        active = bool(self._prompt_tokens or self._generation_tokens or s.num_running or s.num_waiting
                      or s.num_swapped)
        if active or self._was_active:
            queries = s.prefix_cache_queries - self._queries_at_last
            hits = s.prefix_cache_hits - self._hits_at_last
            logger.info(
                "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                "Running: %d reqs, Swapped: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, "
                "Prefix cache hit rate: %.1f%%",
                self._prompt_tokens / elapsed, self._generation_tokens / elapsed, s.num_running, s.num_swapped,
                s.num_waiting, 100 * s.kv_cache_usage, 100 * hits / queries if queries else 0.0)
        self._was_active = active
        self._last_log = now
        self._prompt_tokens = self._generation_tokens = 0
        self._queries_at_last, self._hits_at_last = s.prefix_cache_queries, s.prefix_cache_hits
        spec = (s.spec_decode_num_drafts, s.spec_decode_num_draft_tokens, s.spec_decode_num_accepted_tokens)
        drafts, proposed, accepted = (a - b for a, b in zip(spec, self._spec_at_last))
        if drafts > 0:
            logger.info("Speculative decoding: %d drafts, draft acceptance rate: %.1f%%, mean accepted length: %.2f",
                        drafts, 100 * accepted / proposed, 1 + accepted / drafts)
        self._spec_at_last = spec
