"""Serve a trace on the simulated clock: the real Scheduler and KV cache managers (paged or
the contiguous baselines), with the model replaced by the cost model.

Each step the scheduler plans as in the engine; the clock advances by the cost model's time
for what it scheduled; then the scheduler applies a made-up result (token 1 for every sampled
sequence; for beam search, seeded random candidates) through its own update_from_output.
Requests ignore EOS, so each produces exactly its traced output length; preemption, prefix
caching, parallel sampling and beam search run in the real code.
"""
from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass, field

from pagedserve.batch import RunnerOutput, SamplerOutput
from pagedserve.config import EngineConfig
from pagedserve.request import Request
from pagedserve.sampling_params import BeamSearchParams, SamplingParams
from pagedserve.scheduler import Scheduler, SchedulerOutput
from pagedserve.sim.cost import CostModel, StepWork


EOS = 0          # the made-up model's end-of-sequence token (every other sampled token is 1)


@dataclass
class SimRequest:
    prompt_token_ids: list[int]
    output_len: int             # tokens it generates
    arrival_time: float = 0.0
    n: int = 1                  # parallel samples
    beam_width: int = 0         # > 0: beam search
    # What the request asks for (what a reservation must cover); None: exactly output_len. When
    # larger, the request ends by sampling EOS at output_len, as a chatbot's answer does.
    max_tokens: int | None = None


@dataclass
class SimConfig:
    kv_allocator: str = "paged"
    num_blocks: int = 1000
    block_size: int = 16
    max_model_len: int = 2048
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = False
    admission_watermark: float = EngineConfig.admission_watermark
    preemption_mode: str = "recompute"
    num_host_blocks: int = 0
    seed: int = 0

    def engine_config(self) -> EngineConfig:
        return EngineConfig(block_size=self.block_size, kv_allocator=self.kv_allocator,
                            enable_prefix_caching=self.enable_prefix_caching, max_model_len=self.max_model_len,
                            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                            admission_watermark=self.admission_watermark, preemption_mode=self.preemption_mode)


@dataclass
class SimResult:
    kv_allocator: str
    num_requests: int
    duration_s: float                # first arrival to last finish
    throughput_rps: float            # over the whole run
    steady_throughput_rps: float     # finishes per second between the 10% and 90% marks (see steady_window)
    output_tokens_per_s: float
    mean_normalized_latency: float   # s per output token, mean over requests (the paper's Fig. 12 metric)
    mean_latency_s: float
    avg_batch_size: float            # requests running per step
    saturated_batch_size: float      # ... over the steps while requests waited
    num_steps: int
    num_preemptions: int
    num_recomputed_tokens: int
    sharing_saving_avg: float
    busy_time_s: float               # sum of step times
    step_times: list[float] = field(default_factory=list, repr=False)
    latencies: list[float] = field(default_factory=list, repr=False)

    def summary(self) -> dict:
        d = dict(self.__dict__)
        d.pop("step_times")
        d.pop("latencies")
        return d


def steady_window(arrivals: list[float], finishes: list[float]) -> tuple[float, float]:
    """The interval over which throughput is steady: from the 10% to the 90% arrival (ramp-up
    and drain left out); with every request at t=0, the 10% to the 90% finish."""
    arr, fin = sorted(arrivals), sorted(finishes)
    n = len(arr)
    lo, hi = int(0.1 * n), max(int(0.9 * n) - 1, 0)
    if arr[hi] > arr[lo]:
        return arr[lo], arr[hi]
    return fin[lo], fin[hi]


class Simulation:
    def __init__(self, config: SimConfig, cost: CostModel) -> None:
        self.config, self.cost = config, cost
        self.scheduler = Scheduler(config.engine_config(), config.num_blocks, config.max_model_len,
                                   num_host_blocks=config.num_host_blocks, eos_token_ids=(EOS,))
        self._rng = random.Random(config.seed)
        self._output_len: dict[str, int] = {}

    def _add(self, rid: str, r: SimRequest, arrival: float) -> Request:
        sched = self.scheduler
        max_tokens = r.max_tokens or r.output_len
        stops_early = max_tokens > r.output_len
        params = (BeamSearchParams(beam_width=r.beam_width, max_tokens=max_tokens, ignore_eos=True)
                  if r.beam_width else
                  SamplingParams(n=r.n, temperature=1.0 if r.n > 1 else 0.0, max_tokens=max_tokens,
                                 ignore_eos=not stops_early))
        self._output_len[rid] = r.output_len
        req = Request.create(rid, None, r.prompt_token_ids, params, max_tokens, sched.new_seq_id(),
                             arrival_time=arrival)
        sched.add_request(req)
        return req

    def _result(self, out: SchedulerOutput) -> RunnerOutput:
        """Token 1 for every sampled sequence (EOS at its traced length); beam search gets
        beam_width seeded candidates."""
        rows = out.sampled
        if not rows:
            return RunnerOutput([], None)
        width = max(r.request.params.beam_width if r.request.is_beam_search else 0 for r in rows)
        if not width:
            ends = self._output_len
            return RunnerOutput.of_tokens(
                [r.seq.seq_id for r in rows],
                [EOS if r.seq.num_output_tokens + 1 >= ends[r.request.request_id] else 1 for r in rows])
        rand = self._rng.random
        top_ids = [[2 + k for k in range(width)] for _ in rows]
        top_lps = [sorted((math.log(rand() + 1e-9) for _ in range(width)), reverse=True) for _ in rows]
        return RunnerOutput([r.seq.seq_id for r in rows],
                            SamplerOutput([1] * len(rows), [lp[0] for lp in top_lps], top_ids, top_lps,
                                          [1] * len(rows)))

    def run(self, trace: list[SimRequest], keep_step_times: bool = False) -> SimResult:
        sched = self.scheduler
        pending = deque(sorted(enumerate(trace), key=lambda r: r[1].arrival_time))
        arrival = {str(i): r.arrival_time for i, r in enumerate(trace)}
        if any(r.beam_width and r.max_tokens not in (None, r.output_len) for r in trace):
            raise ValueError("beam search requests generate max_tokens (they ignore EOS)")
        out_len = {str(i): r.output_len for i, r in enumerate(trace)}
        finish: dict[str, float] = {}
        clock = busy = 0.0
        steps = batch_sum = saturated = saturated_sum = 0
        step_times: list[float] = []
        while pending or sched.num_unfinished:
            if not sched.num_unfinished and pending[0][1].arrival_time > clock:
                clock = pending[0][1].arrival_time
            while pending and pending[0][1].arrival_time <= clock:
                i, r = pending.popleft()
                self._add(str(i), r, r.arrival_time)
            out = sched.schedule()
            if out.empty:
                raise RuntimeError(f"the scheduler made no progress: {sched.describe()}")
            work = StepWork.of(((s.start, s.num_new_tokens) for s in out.scheduled), len(out.sampled))
            dt = self.cost.step_time(work).total
            clock += dt
            busy += dt
            if keep_step_times:
                step_times.append(dt)
            running = len(sched.running)
            update = sched.update_from_output(out, self._result(out))
            assert not update.failed, update.failed
            for rid in update.finished:
                finish[rid] = clock
            steps += 1
            batch_sum += running
            if sched.waiting:
                saturated += 1
                saturated_sum += running
        assert sched.kv.num_free_blocks == sched.kv.num_blocks, "KV blocks leaked"
        n = len(trace)
        ids = list(finish)
        latencies = [finish[i] - arrival[i] for i in ids]
        norm = [lat / out_len[i] for i, lat in zip(ids, latencies)]
        start = min(arrival.values())
        duration = max(finish.values()) - start
        lo, hi = steady_window(list(arrival.values()), list(finish.values()))
        in_window = sum(1 for t in finish.values() if lo < t <= hi)
        stats = sched.stats
        return SimResult(
            kv_allocator=self.config.kv_allocator, num_requests=n, duration_s=duration,
            throughput_rps=n / duration, steady_throughput_rps=in_window / (hi - lo) if hi > lo else n / duration,
            output_tokens_per_s=sum(out_len.values()) / duration,
            mean_normalized_latency=sum(norm) / n, mean_latency_s=sum(latencies) / n,
            avg_batch_size=batch_sum / steps, saturated_batch_size=saturated_sum / saturated if saturated else math.nan,
            num_steps=steps, num_preemptions=stats.num_preemptions, num_recomputed_tokens=stats.num_recomputed_tokens,
            sharing_saving_avg=stats.sharing_saving_avg, busy_time_s=busy, step_times=step_times,
            latencies=latencies)


def simulate(trace: list[SimRequest], config: SimConfig, cost: CostModel, keep_step_times: bool = False) -> SimResult:
    return Simulation(config, cost).run(trace, keep_step_times)


def sustained_rate(points: list[tuple[float, float]], bound: float) -> dict:
    """The highest request rate whose normalized latency stays under `bound`, interpolated
    linearly between the last rate under it and the first over it (the paper's reading of
    Fig. 12)."""
    prev = None
    for rate, lat in sorted(points):
        if lat > bound:
            if prev is None:
                return {"rate": None, "note": f"over the bound at the lowest rate tested ({rate:.3g} req/s)"}
            r0, l0 = prev
            return {"rate": r0 + (bound - l0) * (rate - r0) / (lat - l0), "note": "interpolated"}
        prev = (rate, lat)
    if prev is None:
        return {"rate": None, "note": "no runs"}
    return {"rate": prev[0], "note": "at least: under the bound at every rate tested"}
