"""Data-parallel serving without models: many replicas, each the engine's real Scheduler
and KV cache manager, routed by the real Router, on a simulated clock.

A replica's step is planned by its scheduler exactly as in the engine; the "model"
then produces the trace's own output tokens (so a later turn's prompt, which contains
them, finds them in the cache) and the step takes `step_time(batch)` simulated seconds:
`CostStepTime`, the single-engine simulator's step-time model (sim/cost.py: a term per
class of work, a GPU preset's rooflines) priced on what the scheduler planned.
KV events go from each replica's block pool straight into the router's index.
"""
from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedserve.batch import RunnerOutput
from pagedserve.cluster.routing import Router
from pagedserve.config import EngineConfig
from pagedserve.kv.events import KVEventSink
from pagedserve.request import Request
from pagedserve.sampling_params import SamplingParams
from pagedserve.scheduler import Scheduler, SchedulerOutput
from pagedserve.sim.cost import CostModel, StepWork
from pagedserve.sim.devices import DEVICES
from pagedserve.sim.shapes import ModelShape

# Seconds one step of this batch takes.
StepTimeModel = Callable[[SchedulerOutput], float]


class CostStepTime:
    """Seconds of one step from sim/cost.py's CostModel (default: Llama-3-8B on one H100, the
    paged kernel, 16-token blocks)."""

    def __init__(self, cost: CostModel | None = None) -> None:
        self.cost = cost or CostModel(ModelShape.preset("llama-3-8b"), DEVICES["h100"])

    def __call__(self, out: SchedulerOutput) -> float:
        return self.cost.step_time(StepWork.of(((s.start, s.num_new_tokens) for s in out.scheduled),
                                               len(out.sampled))).total


@dataclass
class SimRequest:
    request_id: str
    arrival: float
    prompt: list[int]
    output: list[int]              # the tokens the "model" produces
    cache_salt: str | None = None


@dataclass
class SimResult:
    request_id: str
    replica: int
    arrival: float
    first_scheduled: float
    first_token: float
    finished: float
    num_prompt_tokens: int
    num_cached_tokens: int         # what the replica's prefix cache served
    estimated_cached_tokens: int   # what the router expected it to serve


class SimReplica:
    """One engine without a model: its Scheduler (and KV cache manager) and a clock."""

    def __init__(self, config: EngineConfig, num_blocks: int, max_model_len: int, step_time: StepTimeModel,
                 kv_events: KVEventSink | None = None) -> None:
        self.sched = Scheduler(config, num_blocks, max_model_len, kv_events=kv_events)
        self.step_time = step_time
        self.free_at = 0.0                       # simulated time its current step ends
        self.outputs: dict[int, list[int]] = {}  # seq id -> the tokens its "model" produces

    @property
    def busy(self) -> bool:
        return self.sched.num_unfinished > 0

    def add(self, req: SimRequest) -> Request:
        params = SamplingParams(max_tokens=len(req.output), ignore_eos=True)
        r = Request.create(req.request_id, None, req.prompt, params, len(req.output), self.sched.new_seq_id(),
                           arrival_time=req.arrival, cache_salt=req.cache_salt)
        self.outputs[r.seqs[0].seq_id] = req.output
        self.sched.add_request(r)
        return r

    def step(self, now: float) -> tuple[float, SchedulerOutput, list[Request]]:
        """Run one step starting at `now`; returns its end time, what ran, and the requests
        that finished."""
        out = self.sched.schedule()
        end = now + self.step_time(out)
        ids, tokens = [], []
        for s in out.sampled:
            seq = s.seq
            ids.append(seq.seq_id)
            tokens.append(self.outputs[seq.seq_id][seq.num_tokens - seq.num_prompt_tokens])
        update = self.sched.update_from_output(out, RunnerOutput.of_tokens(ids, tokens))
        finished = [r for r in update.progressed if r.request_id in update.finished]
        for req in finished:
            for seq in req.seqs:
                self.outputs.pop(seq.seq_id, None)
        self.free_at = end
        return end, out, finished


@dataclass
class _Track:
    replica: int
    estimated: int
    first_scheduled: float | None = None
    first_token: float | None = None


@dataclass
class ClusterSim:
    """Replicas behind one Router on a simulated clock."""
    router: Router
    replicas: list[SimReplica]
    results: list[SimResult] = field(default_factory=list)

    @classmethod
    def build(cls, num_replicas: int, policy: str, config: EngineConfig, num_blocks: int, max_model_len: int,
              step_time: StepTimeModel | None = None) -> "ClusterSim":
        router = Router(num_replicas, config.block_size, policy)
        step_time = step_time or CostStepTime()
        replicas = [SimReplica(config, num_blocks, max_model_len, step_time, router.index.sink(i))
                    for i in range(num_replicas)]
        return cls(router, replicas)

    def run(self, trace: list[SimRequest]) -> list[SimResult]:
        """Serve the trace (sorted by arrival) to the end."""
        tracks: dict[str, _Track] = {}
        requests: dict[str, SimRequest] = {r.request_id: r for r in trace}
        arrivals = iter(trace)
        next_arrival = next(arrivals, None)
        steps: list[tuple[float, int]] = []          # (when the replica may step next, replica)
        scheduled = [False] * len(self.replicas)     # replica has an entry in `steps`
        while next_arrival is not None or steps:
            if next_arrival is not None and (not steps or next_arrival.arrival <= steps[0][0]):
                req, now = next_arrival, next_arrival.arrival
                route = self.router.route(req.prompt, req.cache_salt)
                replica = self.replicas[route.replica]
                replica.add(req)
                tracks[req.request_id] = _Track(route.replica, route.matched_blocks * self.router.block_size)
                if not scheduled[route.replica]:
                    heapq.heappush(steps, (max(now, replica.free_at), route.replica))
                    scheduled[route.replica] = True
                next_arrival = next(arrivals, None)
                continue
            now, i = heapq.heappop(steps)
            replica = self.replicas[i]
            end, out, finished = replica.step(now)
            for s in out.scheduled:
                t = tracks[s.request.request_id]
                if t.first_scheduled is None:
                    t.first_scheduled = now
                if s.samples and t.first_token is None:
                    t.first_token = end
            for r in finished:
                t = tracks.pop(r.request_id)
                src = requests.pop(r.request_id)
                self.router.finished(i)
                self.results.append(SimResult(r.request_id, i, src.arrival, t.first_scheduled, t.first_token, end,
                                              len(src.prompt), r.num_cached_tokens, t.estimated))
            if replica.busy:
                heapq.heappush(steps, (end, i))
            else:
                scheduled[i] = False
        return self.results
