"""Several models in one server (issue 52): what switching, loading on demand and unloading cost.

    .venv/bin/python benchmarks/multimodel.py              # the default model, 20 cycles (~3 min quiet)
    .venv/bin/python benchmarks/multimodel.py --quick      # 3 cycles, fewer requests: checks the script

A --models-dir server holding the default model under two names (`a`, `b`), and a one-model
server on the same file, each a subprocess (server/launcher.py). Measured, each a median over
--requests streamed chat requests (greedy, 8 tokens):
  TTFT one-model     time to first token of the one-model server
  TTFT switching     the multi-model server with both loaded, requests alternating a, b, a, ...
  TTFT first request a request for `a` right after /models/unload: its load plus its first token
                     (and the load time the server logs)
Then --cycles load/unload cycles of `a` (/models/load, one request, /models/unload) with the server's
resident memory (VmRSS) read before each load, loaded and after each unload: the growth of the
memory after unload over the cycles (a leak) and each unload's return towards the memory before
its load. Results: a table and benchmarks/results/multimodel.json, with the CPU's flags.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.vs_vllm import cpu_flags, cpu_model  # noqa: E402
from pagedserve.models.loader import default_model_path  # noqa: E402
from pagedserve.server.launcher import launch_server  # noqa: E402

MESSAGES = [{"role": "user", "content": "Name three colours."}]


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def ttft(client: httpx.Client, model: str) -> float:
    start = time.perf_counter()
    with client.stream("POST", "/v1/chat/completions", json={"model": model, "messages": MESSAGES, "max_tokens": 8,
                                                             "temperature": 0, "stream": True}) as r:
        r.raise_for_status()
        first = None
        for line in r.iter_lines():
            if first is None and line.startswith("data: ") and '"content"' in line:
                first = time.perf_counter() - start
    if first is None:
        raise RuntimeError("no token")
    return first


def median_ttft(client: httpx.Client, models: list[str], n: int) -> float:
    ttft(client, models[0])   # warm
    return statistics.median(ttft(client, models[i % len(models)]) for i in range(n))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cycles", type=int, default=20)
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--kv-cache-memory", default="256MiB")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "multimodel.json"))
    args = p.parse_args()
    if args.quick:
        args.cycles, args.requests = 3, 4
    path = default_model_path()
    common = ["--kv-cache-memory", args.kv_cache_memory, "--disable-log-requests", "--disable-uvicorn-access-log",
              "--disable-log-stats", "--shutdown-timeout", "0"]
    tmp = Path(tempfile.mkdtemp(prefix="multimodel-bench-"))
    result: dict = dict(args=vars(args), cpu_model=cpu_model(), cpu_flags=cpu_flags(), threads=os.cpu_count())

    with launch_server(path, common, tmp / "one.log") as one, httpx.Client(base_url=one.url, timeout=300) as c:
        result["ttft_one_model_s"] = median_ttft(c, [c.get("/v1/models").json()["data"][0]["id"]], args.requests)

    models = tmp / "models"
    models.mkdir()
    for name in ("a", "b"):
        (models / f"{name}.gguf").symlink_to(path)
    with launch_server(None, ["--models-dir", str(models), *common], tmp / "multi.log") as srv, \
            httpx.Client(base_url=srv.url, timeout=300) as c:
        pid = srv.proc.pid
        start_rss = rss(pid)
        for name in ("a", "b"):
            c.post("/models/load", json={"model": name}).raise_for_status()
        result["ttft_switching_s"] = median_ttft(c, ["a", "b"], args.requests)
        result["ttft_one_of_two_s"] = median_ttft(c, ["a"], args.requests)
        c.post("/models/unload", json={"model": "b"}).raise_for_status()
        first = []
        for _ in range(3):
            c.post("/models/unload", json={"model": "a"}).raise_for_status()
            first.append(ttft(c, "a"))
        result["ttft_first_request_s"] = statistics.median(first)
        loads = [float(line.split(" loaded in ")[1].split(" s ")[0]) for line in srv.log().splitlines()
                 if "model a loaded in" in line]
        result["load_s"] = statistics.median(loads[-3:])
        c.post("/models/unload", json={"model": "a"}).raise_for_status()
        cycles = []
        for i in range(args.cycles):
            before = rss(pid)
            c.post("/models/load", json={"model": "a"}).raise_for_status()
            ttft(c, "a")
            loaded = rss(pid)
            c.post("/models/unload", json={"model": "a"}).raise_for_status()
            after = rss(pid)
            cycles.append({"before": before, "loaded": loaded, "after": after})
            print(f"cycle {i + 1}: before {before / 2**20:.0f} MiB, loaded {loaded / 2**20:.0f} MiB, "
                  f"after unload {after / 2**20:.0f} MiB", flush=True)
        result["rss_start"] = start_rss
        result["cycles"] = cycles
    first_after, last_after = cycles[0]["after"], cycles[-1]["after"]
    result["rss_growth_over_cycles"] = (last_after - first_after) / first_after
    result["worst_after_vs_before"] = max(c["after"] / c["before"] - 1 for c in cycles)

    print()
    print("| measure | value |")
    print("|---|---|")
    print(f"| TTFT, one-model server (median of {args.requests}) | {result['ttft_one_model_s'] * 1e3:.0f} ms |")
    print(f"| TTFT, two loaded models, alternating | {result['ttft_switching_s'] * 1e3:.0f} ms |")
    print(f"| TTFT, one of two loaded models | {result['ttft_one_of_two_s'] * 1e3:.0f} ms |")
    print(f"| TTFT, first request after unload (load + first token) | {result['ttft_first_request_s'] * 1e3:.0f} ms "
          f"(load {result['load_s'] * 1e3:.0f} ms) |")
    print(f"| RSS at start, after the first unload, after the last | {start_rss / 2**20:.0f} / "
          f"{first_after / 2**20:.0f} / {last_after / 2**20:.0f} MiB |")
    print(f"| RSS after unload over {args.cycles} cycles | {result['rss_growth_over_cycles'] * 100:+.1f}% |")
    print(f"| worst unload vs the memory before its load | {result['worst_after_vs_before'] * 100:+.1f}% |")
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"CPU: {result['cpu_model']} ({' '.join(result['cpu_flags'])}); wrote {args.out}")


if __name__ == "__main__":
    main()
