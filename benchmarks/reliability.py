"""Red-team reliability probe: replay the bad-input catalogue and the fault cases against a
running server and report, per case, whether the server answered as it must, the status, the
time to answer, and the KV blocks used and server RSS before and after.

    .venv/bin/python benchmarks/reliability.py          # table on stdout, JSON in results/

Two servers on 127.0.0.1 (free ports), both on the tests' tiny random-weight model (built in a
temporary directory, so the catalogue's limits such as the 512-token context hold):
1. the catalogue server, with the limits tests/test_server_bad_input.py sets, replays its
   CATALOGUE (imported from there, not copied);
2. a server with the default limits and the test fault hooks (tests/fault_server.py) takes the
   large inputs, beam-search length_penalty extremes, client disconnects, a fault in one
   request, a failed step, and last a fault that kills the engine (the server must exit 1).
A case passes if the status is the expected one, no KV block is left held, and the server
still answers /health 200 (503 and exit status 1 for the fatal case).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pagedserve.server.launcher import ServerProcess, launch_server  # noqa: E402
from tests.conftest import build_tokenizer, make_tiny_model  # noqa: E402
from tests.fault_server import FATAL_FAULT, REQUEST_FAULT, STEP_FAULT  # noqa: E402
from tests.server_utils import API_KEY, KV_BLOCKS, PROMPT, rss_bytes, tiny_server_args, wait_idle  # noqa: E402
from tests.test_server_bad_input import CATALOGUE, MAX_BODY, MAX_SEQS, MAX_WAITING, send  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "reliability.json"
TEN_MB = "Paged attention stores keys and values in fixed-size blocks. " * 170_000
GREEDY = {"temperature": 0, "ignore_eos": True}


@dataclass
class CaseResult:
    group: str
    name: str
    expected: str
    status: int | None
    passed: bool
    seconds: float
    kv_blocks_before: int
    kv_blocks_after: int
    rss_mb_before: float
    rss_mb_after: float
    health_after: int | None


def kv_blocks(http: httpx.Client) -> int:
    return round(wait_idle(http)["pagedserve:kv_cache_usage_perc"] * KV_BLOCKS)


def run_case(srv: ServerProcess, http: httpx.Client, group: str, name: str, expected: set[int],
             call: Callable[[], int | None], health_expected: int = 200) -> CaseResult:
    before_kv, before_rss = kv_blocks(http), rss_bytes(srv.proc.pid)
    start = time.monotonic()
    try:
        status = call()
    except httpx.HTTPError as e:
        status = None
        print(f"  {name}: {type(e).__name__}: {e}", file=sys.stderr)
    seconds = time.monotonic() - start
    health = srv.health()
    alive = srv.proc.poll() is None
    after_kv = kv_blocks(http) if alive and health == 200 else before_kv
    after_rss = rss_bytes(srv.proc.pid) if alive else 0
    passed = status in expected and health == health_expected and after_kv == 0
    return CaseResult(group, name, "/".join(map(str, sorted(expected))), status, passed, seconds, before_kv,
                      after_kv, before_rss / 2**20, after_rss / 2**20, health)


def catalogue_cases(model: str, tmp: Path) -> list[CaseResult]:
    srv = launch_server(model, tiny_server_args(
        "--api-key", API_KEY, "--served-model-name", "tiny", "--shutdown-timeout", "0", "--max-num-seqs",
        str(MAX_SEQS), "--max-waiting-requests", str(MAX_WAITING), "--max-request-body-bytes", str(MAX_BODY)),
        tmp / "catalogue.log")
    try:
        with httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as http:
            return [run_case(srv, http, "catalogue", bad.name, {bad.status}, lambda bad=bad: send(http, bad).status_code)
                    for bad in CATALOGUE]
    finally:
        srv.stop()


def disconnect_mid_stream(http: httpx.Client) -> int:
    body = {"prompt": PROMPT, "max_tokens": 400, "stream": True, **GREEDY}
    with http.stream("POST", "/v1/completions", json=body) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
        return r.status_code   # leaving the block closes the connection mid-stream


def disconnect_before_answer(url: str) -> int:
    """A non-streaming request whose client gives up (timeout) before the answer."""
    try:
        httpx.post(url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 400, **GREEDY}, timeout=0.2)
    except httpx.TimeoutException:
        return 499   # nginx's "client closed request": what the client did
    return 200


def fault_cases(model: str, tmp: Path) -> list[CaseResult]:
    srv = launch_server(model, tiny_server_args("--shutdown-timeout", "0"), tmp / "faults.log",
                        module="tests.fault_server")
    out = []
    try:
        with httpx.Client(base_url=srv.url, timeout=120) as http:
            def post(path: str, body: dict) -> Callable[[], int]:
                return lambda: http.post(path, json=body).status_code
            beam = {"prompt": "hi", "max_tokens": 2, "n": 2, "use_beam_search": True}
            cases = [
                ("large", "10-MB-prompt", {400}, post("/v1/completions", {"prompt": TEN_MB})),
                ("large", "250k-prompts", {400}, post("/v1/completions", {"prompt": ["x"] * 250_000})),
                ("large", "1M-token-ids", {400}, post("/v1/completions", {"prompt": [5] * 1_000_000})),
                ("large", "10-MB-chat", {400}, post("/v1/chat/completions",
                                                    {"messages": [{"role": "user", "content": TEN_MB}]})),
                ("large", "10-MB-tokenize", {400}, post("/tokenize", {"prompt": TEN_MB})),
                ("beam", "length-penalty-1e9", {400}, post("/v1/completions", {**beam, "length_penalty": 1e9})),
                ("beam", "length-penalty-minus-1e9", {400}, post("/v1/completions",
                                                                 {**beam, "length_penalty": -1e9})),
                ("beam", "length-penalty-100", {200}, post("/v1/completions", {**beam, "length_penalty": 100})),
                ("beam", "length-penalty-minus-100", {200}, post("/v1/completions",
                                                                 {**beam, "length_penalty": -100})),
                ("disconnect", "mid-stream", {200}, lambda: disconnect_mid_stream(http)),
                ("disconnect", "before-the-answer", {499}, lambda: disconnect_before_answer(srv.url)),
                ("fault", "in-one-request", {500}, post("/v1/completions",
                                                        {"prompt": f"{PROMPT} {REQUEST_FAULT}", "max_tokens": 8})),
                ("fault", "failed-step", {500}, post("/v1/completions",
                                                     {"prompt": f"{PROMPT} {STEP_FAULT}", "max_tokens": 8})),
                ("fault", "normal-request-after-faults", {200}, post("/v1/completions",
                                                                     {"prompt": PROMPT, "max_tokens": 8})),
            ]
            out = [run_case(srv, http, *case) for case in cases]
            fatal = run_case(srv, http, "fault", "engine-dies (then exit status 1)", {500, 503},
                             post("/v1/completions", {"prompt": FATAL_FAULT, "max_tokens": 8}),
                             health_expected=None)
            try:
                code = srv.proc.wait(60)
            except subprocess.TimeoutExpired:
                code = None
            # /health: 503, or nothing once the server has closed its socket on the way out.
            fatal.passed = fatal.status in (500, 503) and fatal.health_after in (503, None) and code == 1
            out.append(fatal)
    finally:
        srv.stop()
    return out


def print_table(results: list[CaseResult]) -> None:
    print(f"{'case':<48} {'ok':<4} {'want':>7} {'got':>4} {'time s':>8} {'KV before':>9} {'KV after':>8} "
          f"{'RSS MB before':>13} {'RSS MB after':>12}")
    for r in results:
        print(f"{r.group + '/' + r.name:<48} {'pass' if r.passed else 'FAIL':<4} {r.expected:>7} "
              f"{str(r.status):>4} {r.seconds:8.3f} {r.kv_blocks_before:9d} {r.kv_blocks_after:8d} "
              f"{r.rss_mb_before:13.1f} {r.rss_mb_after:12.1f}")
    failed = [r.name for r in results if not r.passed]
    print(f"\n{len(results) - len(failed)}/{len(results)} cases passed" + (f"; failed: {failed}" if failed else ""))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model = make_tiny_model(tmp, "llama_gqa_untied", build_tokenizer()).path
        results = catalogue_cases(model, tmp) + fault_cases(model, tmp)
    print_table(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": "tests' tiny llama_gqa_untied (random weights)",
                                    "cases": [asdict(r) for r in results]}, indent=1))
    print(f"wrote {args.out}")
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
