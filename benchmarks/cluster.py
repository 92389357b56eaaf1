"""Data-parallel routing benchmark: each routing policy on a multi-tenant shared-prefix workload.

    .venv/bin/python benchmarks/cluster.py --quick           # what the lead runs (a few minutes)
    .venv/bin/python benchmarks/cluster.py --part sim --sim-requests 100000
    .venv/bin/python benchmarks/cluster.py --smoke           # seconds: checks the script works

The workload: --systems system prompts (tenants) of 200-600 tokens; users arrive as a
Poisson process, each picks a tenant and sends --turns turns, a think time apart; turn k's
prompt is the system prompt, the conversation so far (earlier user messages and replies)
and a new message, so a user's later turns reuse their earlier turns' blocks and every
user reuses their tenant's system prompt. Token ids are random (seeded); the replies in the
history are the trace's, so a turn finds cached exactly the previous turn's prompt.

Part `real`: `--replicas` (2) replicas of the default model as Ray actors on a local Ray
instance, one thread each, behind the router (DataParallelLLM, in this process; no HTTP),
for each policy: prefix-cache hit rate (prompt tokens served from the cache), TTFT mean
and p99, output tokens/s, load imbalance (busiest replica's requests / the mean), and the
router's estimated vs the replicas' actual hit tokens.

Part `sim`: the same policies at 8, 32 and 128 replicas without models (pagedserve/cluster/
sim.py: each replica the real Scheduler and KV cache manager, a step-time model, a
simulated clock) on a trace of --sim-requests requests: hit rate, queueing delay (arrival
to first scheduled) mean and p99, TTFT, imbalance. Simulated seconds: the routing and
caching are the real code, the times come from sim.CostStepTime (sim/cost.py's step-time model, Llama-3-8B on an H100 preset).

Writes benchmarks/results/cluster.json (a run of one part keeps the other's last results) and
cluster.png; prints markdown tables.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from pagedserve.cluster.sim import ClusterSim, SimRequest  # noqa: E402
from pagedserve.config import ROUTING_POLICIES, EngineConfig  # noqa: E402

VOCAB = (100, 49000)   # token ids drawn from here (SmolLM2's vocabulary has 49152)


def multi_tenant_trace(num_requests: int, num_systems: int, turns: int, user_rate: float, seed: int,
                       system_len: tuple[int, int] = (200, 600), message_len: tuple[int, int] = (20, 80),
                       output_len: tuple[int, int] = (16, 48), think_time: float = 5.0) -> list[SimRequest]:
    """Requests sorted by arrival; users arrive at `user_rate` per second until there are
    num_requests turns."""
    rng = random.Random(seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(*VOCAB) for _ in range(n)]

    systems = [toks(rng.randrange(*system_len)) for _ in range(num_systems)]
    out: list[SimRequest] = []
    t, user = 0.0, 0
    while len(out) < num_requests:
        t += rng.expovariate(user_rate)
        history = list(rng.choice(systems))
        arrival = t
        for turn in range(min(turns, num_requests - len(out))):
            history += toks(rng.randrange(*message_len))
            reply = toks(rng.randrange(*output_len))
            out.append(SimRequest(f"u{user}-t{turn}", arrival, list(history), reply))
            history += reply
            arrival += rng.expovariate(1 / think_time)
        user += 1
    out.sort(key=lambda r: r.arrival)
    return out


def summarize(ttfts: list[float], prompt: int, cached: int, per_replica: list[int], extra: dict) -> dict:
    ttft = np.array(ttfts) if ttfts else np.zeros(1)
    return dict(hit_rate=cached / max(1, prompt), ttft_mean=float(ttft.mean()), ttft_p99=float(np.percentile(ttft, 99)),
                imbalance=max(per_replica) / max(1e-9, float(np.mean(per_replica))), requests_per_replica=per_replica,
                **extra)


# ---- part real: Ray replicas of the default model -----------------------------------------------
async def run_real_policy(policy: str, trace: list[SimRequest], args) -> dict:
    from pagedserve.cluster.client import DataParallelLLM
    from pagedserve.sampling_params import SamplingParams
    from pagedserve.server.metrics import PrometheusStatLogger
    config = EngineConfig(model=args.model, kv_cache_memory=args.kv_cache_memory, max_model_len=args.max_model_len)
    llm = DataParallelLLM(config, args.replicas, PrometheusStatLogger("pagedserve", num_engines=args.replicas),
                          routing_policy=policy)
    llm.start()
    await llm.wait_started()
    ttfts, where = [], {}
    prompt_tokens = cached = out_tokens = 0

    async def one(req: SimRequest) -> None:
        nonlocal prompt_tokens, cached, out_tokens
        await asyncio.sleep(max(0.0, req.arrival - (time.monotonic() - start)))
        sent = time.monotonic()
        params = SamplingParams(max_tokens=len(req.output), ignore_eos=True, temperature=0)
        stream = await llm.add_requests([(req.request_id, {"prompt": None, "prompt_token_ids": req.prompt}, params)])
        where[req.request_id] = stream.replica_of[req.request_id]
        first = None
        async for o in stream:
            if first is None and o.outputs and o.outputs[0].token_ids:
                first = time.monotonic() - sent
            if o.finished:
                prompt_tokens += len(req.prompt)
                cached += o.num_cached_tokens
                out_tokens += len(o.outputs[0].token_ids)
        ttfts.append(first or 0.0)

    start = time.monotonic()
    await asyncio.gather(*(one(r) for r in trace))
    elapsed = time.monotonic() - start
    c = llm.router.counters
    per_replica = [sum(1 for w in where.values() if w == i) for i in range(args.replicas)]
    await llm.shutdown()
    return summarize(ttfts, prompt_tokens, cached, per_replica, dict(
        policy=policy, requests=len(trace), output_tok_s=out_tokens / elapsed, elapsed_s=elapsed,
        router_estimated_hit_tokens=c.estimated_hit_tokens, actual_hit_tokens=cached,
        decisions=dict(c.decisions)))


def run_real(args) -> list[dict]:
    from pagedserve.cluster.client import init_ray
    import ray
    init_ray(None, num_cpus=args.replicas)
    trace = multi_tenant_trace(args.real_requests, args.systems, args.turns, args.user_rate, args.seed,
                               output_len=(args.output_len // 2, args.output_len), think_time=args.think_time)
    rows = []
    try:
        for policy in args.policies:
            row = asyncio.run(run_real_policy(policy, trace, args))
            print(f"real {policy}: {row['hit_rate']:.3f} hit rate, {row['elapsed_s']:.1f} s", file=sys.stderr)
            rows.append(row)
    finally:
        ray.shutdown()
    return rows


# ---- part sim: many model-free replicas ---------------------------------------------------------
def run_sim(args) -> list[dict]:
    config = EngineConfig(block_size=16, max_num_seqs=args.sim_max_num_seqs, max_num_batched_tokens=2048)
    rows = []
    for n in args.sim_replicas:
        # Tenants and users scale with the cluster; users arrive so that each replica sees
        # --sim-rate requests per simulated second.
        trace = multi_tenant_trace(args.sim_requests, max(args.systems, 2 * n), args.turns,
                                   args.sim_rate * n / args.turns, args.seed + n,
                                   output_len=(args.output_len // 2, args.output_len), think_time=args.think_time)
        for policy in args.policies:
            t0 = time.perf_counter()
            sim = ClusterSim.build(n, policy, config, args.sim_blocks, max_model_len=8192)
            results = sim.run(trace)
            queue = np.array([r.first_scheduled - r.arrival for r in results])
            per_replica = [0] * n
            for r in results:
                per_replica[r.replica] += 1
            row = summarize([r.first_token - r.arrival for r in results],
                            sum(r.num_prompt_tokens for r in results), sum(r.num_cached_tokens for r in results),
                            per_replica, dict(
                                policy=policy, replicas=n, requests=len(results),
                                queue_mean=float(queue.mean()), queue_p99=float(np.percentile(queue, 99)),
                                router_estimated_hit_tokens=sim.router.counters.estimated_hit_tokens,
                                decisions=dict(sim.router.counters.decisions)))
            row.pop("requests_per_replica")
            rows.append(row)
            print(f"sim {n} replicas {policy}: {row['hit_rate']:.3f} hit rate "
                  f"({time.perf_counter() - t0:.0f} s wall)", file=sys.stderr)
    return rows


def tables(real: list[dict], sim: list[dict]) -> str:
    lines = []
    if real:
        lines += ["| policy | prefix hit rate | TTFT mean (s) | TTFT p99 (s) | output tok/s | imbalance | est./actual hit tokens |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['policy']} | {r['hit_rate']:.3f} | {r['ttft_mean']:.3f} | {r['ttft_p99']:.3f} | "
                  f"{r['output_tok_s']:.1f} | {r['imbalance']:.2f} | "
                  f"{r['router_estimated_hit_tokens']}/{r['actual_hit_tokens']} |" for r in real]
        lines.append("")
    if sim:
        lines += ["| replicas | policy | prefix hit rate | queueing mean (s) | queueing p99 (s) | TTFT mean (s) | "
                  "TTFT p99 (s) | imbalance |", "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['replicas']} | {r['policy']} | {r['hit_rate']:.3f} | {r['queue_mean']:.3f} | "
                  f"{r['queue_p99']:.3f} | {r['ttft_mean']:.3f} | {r['ttft_p99']:.3f} | {r['imbalance']:.2f} |"
                  for r in sim]
    return "\n".join(lines)


def plot(sim: list[dict], path: Path) -> None:
    if not sim:
        return
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for policy in dict.fromkeys(r["policy"] for r in sim):
        rows = [r for r in sim if r["policy"] == policy]
        xs = [r["replicas"] for r in rows]
        axes[0].plot(xs, [r["hit_rate"] for r in rows], marker="o", label=policy)
        axes[1].plot(xs, [r["queue_p99"] for r in rows], marker="o", label=policy)
    for ax, title in zip(axes, ("prefix-cache hit rate", "queueing delay p99 (simulated s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("replicas")
        ax.set_title(title)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["real", "sim", "both"], default="both")
    ap.add_argument("--policies", nargs="+", default=list(ROUTING_POLICIES), choices=ROUTING_POLICIES)
    ap.add_argument("--systems", type=int, default=16, help="system prompts (tenants)")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--output-len", type=int, default=32, help="replies are output-len/2 .. output-len tokens")
    ap.add_argument("--think-time", type=float, default=5.0, help="mean seconds between a user's turns")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help="real part (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--replicas", type=int, default=2, help="real part")
    ap.add_argument("--real-requests", type=int, default=96)
    ap.add_argument("--user-rate", type=float, default=0.5, help="real part: users arriving per second")
    ap.add_argument("--kv-cache-memory", type=int, default=64 * 1024**2, help="real part: bytes per replica")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--sim-replicas", type=int, nargs="+", default=[8, 32, 128])
    ap.add_argument("--sim-requests", type=int, default=100_000)
    ap.add_argument("--sim-rate", type=float, default=20.0, help="requests per replica per simulated second")
    ap.add_argument("--sim-blocks", type=int, default=1024, help="KV blocks (16 tokens) per simulated replica")
    ap.add_argument("--sim-max-num-seqs", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="the lead's mode: 24 real requests, 3k simulated")
    ap.add_argument("--smoke", action="store_true", help="a few requests of each part, to check the script")
    ap.add_argument("--out", default="benchmarks/results/cluster")
    args = ap.parse_args()
    if args.quick:
        args.real_requests, args.sim_requests, args.user_rate = 24, 3_000, 1.0
    if args.smoke:
        args.real_requests, args.sim_requests, args.sim_replicas = 6, 300, [2, 4]
        args.user_rate, args.output_len, args.systems, args.turns = 4.0, 4, 2, 2
    real = run_real(args) if args.part in ("real", "both") else []
    sim = run_sim(args) if args.part in ("sim", "both") else []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in vars(args).items() if k not in ("out",)}
    path = out.with_suffix(".json")
    saved = json.loads(path.read_text()) if path.exists() else {}
    # A run of one part keeps the other part's last results (and the settings they ran with).
    record = {"real": dict(settings=settings, rows=real) if real else saved.get("real"),
              "sim": dict(settings=settings, rows=sim) if sim else saved.get("sim")}
    path.write_text(json.dumps(record, indent=1))
    plot(sim, out.with_suffix(".png"))
    print(tables(real, sim))


if __name__ == "__main__":
    main()
