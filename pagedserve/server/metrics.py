"""Prometheus metrics with vLLM's names under the `pagedserve:` prefix (--metrics-prefix vllm:
gives vLLM's own names, so its Grafana dashboards work).

A stat logger for AsyncLLM: it is called on the engine thread after every step
(and after adds/aborts); prometheus-client's metrics are thread-safe and
/metrics renders the registry from the event loop.
"""
from __future__ import annotations

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,  # noqa: F401
                               disable_created_metrics, generate_latest)

from pagedserve.engine.stats import IterationStats, SchedulerStats

PREFIX = "pagedserve:"

# No `_created` series (as vLLM): they double the output and no dashboard reads them.
disable_created_metrics()

LATENCY_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                   10.0, 20.0, 40.0, 80.0, 160.0, 640.0]
ITL_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0]
TOKEN_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000]


class PrometheusStatLogger:
    """One engine's series (labelled model_name), or with `num_engines` those of several
    data-parallel engines, each labelled engine="0", engine="1", ... as vLLM labels them."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None,
                 num_engines: int | None = None, prefix: str = PREFIX) -> None:
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name
        self.prefix = prefix
        label = ["model_name"] + (["engine"] if num_engines else [])
        engines = [(model_name, str(i)) for i in range(num_engines)] if num_engines else [(model_name,)]
        r = self.registry

        def gauge(name: str, doc: str) -> list[Gauge]:
            family = Gauge(prefix + name, doc, label, registry=r)
            return [family.labels(*e) for e in engines]

        def counter(name: str, doc: str) -> list[Counter]:
            family = Counter(prefix + name, doc, label, registry=r)
            return [family.labels(*e) for e in engines]

        def histogram(name: str, doc: str, buckets: list[float]) -> list[Histogram]:
            family = Histogram(prefix + name, doc, label, buckets=buckets, registry=r)
            return [family.labels(*e) for e in engines]

        series = dict(
            num_requests_running=gauge("num_requests_running", "Requests in the running batch."),
            num_requests_waiting=gauge("num_requests_waiting", "Requests waiting to be scheduled."),
            num_requests_swapped=gauge("num_requests_swapped", "Requests preempted to swap space."),
            kv_cache_usage=gauge("kv_cache_usage_perc", "KV cache usage: fraction of blocks in use (0..1)."),
            prefix_cache_queries=counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
            prefix_cache_hits=counter("prefix_cache_hits", "Prompt tokens found in the prefix cache."),
            external_prefix_cache_queries=counter("external_prefix_cache_queries", "Prompt tokens looked up in the "
                                                  "disk tier below the prefix cache (past the pool's hits)."),
            external_prefix_cache_hits=counter("external_prefix_cache_hits", "Of those, tokens the disk tier held."),
            kv_offload_blocks=gauge("kv_offload_blocks", "KV blocks the disk tier holds."),
            kv_offload_bytes_written=counter("kv_offload_bytes_written", "Bytes of KV blocks written to the disk tier."),
            kv_offload_bytes_read=counter("kv_offload_bytes_read", "Bytes of KV blocks read back from the disk tier."),
            num_preemptions=counter("num_preemptions", "Preemptions of running requests."),
            num_swapped_out_blocks=counter("num_swapped_out_blocks", "KV blocks copied to swap space."),
            num_swapped_in_blocks=counter("num_swapped_in_blocks", "KV blocks copied back from swap space."),
            num_recomputed_tokens=counter("num_recomputed_tokens",
                                          "Computed tokens thrown away by recompute preemption."),
            spec_decode_num_drafts=counter("spec_decode_num_drafts", "Speculative decoding: sequence steps "
                                                                     "with drafts verified."),
            spec_decode_num_draft_tokens=counter("spec_decode_num_draft_tokens", "Draft tokens proposed."),
            spec_decode_num_accepted_tokens=counter("spec_decode_num_accepted_tokens", "Draft tokens accepted."),
            prompt_tokens=counter("prompt_tokens", "Prompt tokens processed."),
            generation_tokens=counter("generation_tokens", "Tokens generated."),
        )
        per_pos = Counter(prefix + "spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, by "
                          "position in the draft.", label + ["position"], registry=r)
        success = Counter(prefix + "request_success", "Finished requests by finish reason.",
                          label + ["finished_reason"], registry=r)
        series.update(
            iteration_tokens=histogram("iteration_tokens_total",
                                       "Tokens per engine step (prompts of requests that got their first "
                                       "token, plus generated tokens).", TOKEN_BUCKETS),
            ttft=histogram("time_to_first_token_seconds", "Time to first token.", LATENCY_BUCKETS),
            itl=histogram("inter_token_latency_seconds", "Time between a request's consecutive steps.",
                          ITL_BUCKETS),
            # vLLM's older name of the same observations, which its Grafana dashboard plots.
            tpot=histogram("time_per_output_token_seconds", "Time per output token (between a request's "
                           "consecutive steps).", ITL_BUCKETS),
            e2e=histogram("e2e_request_latency_seconds", "Arrival to finish.", LATENCY_BUCKETS),
            queue_time=histogram("request_queue_time_seconds", "Arrival to first scheduled.", LATENCY_BUCKETS),
            request_prompt_tokens=histogram("request_prompt_tokens", "Prompt tokens per request.", TOKEN_BUCKETS),
            request_generation_tokens=histogram("request_generation_tokens", "Tokens generated per request.",
                                                TOKEN_BUCKETS),
        )
        # vLLM's lora_requests_info: one series whose labels name the adapters running and waiting
        # (comma-separated) and max_lora; its value is when it was set. Only with LoRA on.
        lora_info = Gauge(prefix + "lora_requests_info", "Running and waiting LoRA adapters (labels).",
                          ["running_lora_adapters", "waiting_lora_adapters", "max_lora"], registry=r)
        lora_requests = Counter(prefix + "lora_requests", "Finished requests per LoRA adapter.",
                                label + ["lora_name"], registry=r)
        # A hybrid model's KV groups (kv/groups.py): the device blocks each holds, labelled by group.
        group_blocks = Gauge(prefix + "kv_group_blocks", "KV blocks each KV group's tables hold (a hybrid model's "
                             "full-attention and sliding-window groups).", label + ["kv_group"], registry=r)
        self.engines = [EngineSeries({k: v[i] for k, v in series.items()}, success, e, per_pos, lora_info,
                                     lora_requests, group_blocks)
                        for i, e in enumerate(engines)]

    def record(self, s: SchedulerStats, it: IterationStats | None) -> None:
        """The single engine's stats (AsyncLLM calls this on its engine thread)."""
        self.engines[0].record(s, it)

    def record_engine(self, engine: int, s: SchedulerStats, it: IterationStats | None) -> None:
        self.engines[engine].record(s, it)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class EngineSeries:
    """One engine's children of the metric families."""

    def __init__(self, series: dict, success: Counter, labels: tuple[str, ...], per_pos: Counter | None = None,
                 lora_info: Gauge | None = None, lora_requests: Counter | None = None,
                 group_blocks: Gauge | None = None) -> None:
        self.__dict__.update(series)
        self._group_blocks = group_blocks
        self._lora_requests = lora_requests
        self._lora_info = lora_info
        self._lora_labels: tuple | None = None
        self._per_pos = per_pos
        self._success = success
        self._labels = labels
        for reason in ("stop", "length", "abort"):
            success.labels(*labels, reason)   # present at 0 from the start
        self._last = SchedulerStats()

    def record(self, s: SchedulerStats, it: IterationStats | None) -> None:
        self.num_requests_running.set(s.num_running)
        self.num_requests_waiting.set(s.num_waiting)
        self.num_requests_swapped.set(s.num_swapped)
        self.kv_cache_usage.set(s.kv_cache_usage)
        self.kv_offload_blocks.set(s.kv_offload_blocks)
        if self._group_blocks is not None:
            for group, blocks in s.kv_group_blocks:
                self._group_blocks.labels(*self._labels, group).set(blocks)
        if s.max_lora and self._lora_info is not None:
            labels = (",".join(sorted(s.running_lora_adapters)), ",".join(sorted(s.waiting_lora_adapters)),
                      str(s.max_lora))
            if labels != self._lora_labels:
                self._lora_info.clear()
                self._lora_info.labels(*labels).set_to_current_time()
                self._lora_labels = labels
        # The engine reports cumulative counts; counters only move forward.
        self.prefix_cache_queries.inc(max(0, s.prefix_cache_queries - self._last.prefix_cache_queries))
        self.prefix_cache_hits.inc(max(0, s.prefix_cache_hits - self._last.prefix_cache_hits))
        for name in ("num_preemptions", "num_swapped_out_blocks", "num_swapped_in_blocks", "num_recomputed_tokens",
                     "external_prefix_cache_queries", "external_prefix_cache_hits", "kv_offload_bytes_written",
                     "kv_offload_bytes_read",
                     "spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens"):
            getattr(self, name).inc(max(0, getattr(s, name) - getattr(self._last, name)))
        if self._per_pos is not None:
            last = self._last.spec_decode_num_accepted_tokens_per_pos
            for pos, n in enumerate(s.spec_decode_num_accepted_tokens_per_pos):
                delta = n - (last[pos] if pos < len(last) else 0)
                if delta > 0:
                    self._per_pos.labels(*self._labels, str(pos)).inc(delta)
        self._last = s
        if it is None or it.empty:
            return
        self.prompt_tokens.inc(it.num_prompt_tokens)
        self.generation_tokens.inc(it.num_generation_tokens)
        if it.num_prompt_tokens or it.num_generation_tokens:
            self.iteration_tokens.observe(it.num_prompt_tokens + it.num_generation_tokens)
        for t in it.time_to_first_tokens:
            self.ttft.observe(t)
        for t in it.inter_token_latencies:
            self.itl.observe(t)
            self.tpot.observe(t)
        for f in it.finished:
            self._success.labels(*self._labels, f.finish_reason).inc()
            if f.lora_name is not None and self._lora_requests is not None:
                self._lora_requests.labels(*self._labels, f.lora_name).inc()
            self.e2e.observe(f.e2e_latency)
            if f.queue_time is not None:
                self.queue_time.observe(f.queue_time)
            self.request_prompt_tokens.observe(f.num_prompt_tokens)
            self.request_generation_tokens.observe(f.num_generation_tokens)

    def restart(self) -> None:
        """The engine started afresh (a restarted replica): its cumulative counts start at 0."""
        self._last = SchedulerStats()
