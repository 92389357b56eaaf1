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
3. round three (issue 34), on a server with the fault hooks and a short compile time limit:
   tests/test_server_hostile.py's CASES (structured outputs, tools, chat options: each a 400),
   a compile stuck past the limit, 100k empty messages, distinct large enums (the memory each
   client adds: the compiled-grammar cache is bounded in bytes), a salted prompt read back
   through /v1/kv/snapshot (must not be), while another client streams: per case, the largest
   gap between that client's chunks ("stall") is reported; then a SIGTERM with a stuck compile,
   a stuck template render and a stream in flight: every client answered 503 and the time to
   exit.

    .venv/bin/python benchmarks/reliability.py --quick   # round three only, fewer cases (< 3 min)
"""
from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pagedserve.server.launcher import ServerProcess, launch_server  # noqa: E402
from tests.conftest import build_tokenizer, make_tiny_model  # noqa: E402
from tests.fault_server import (FATAL_FAULT, REQUEST_FAULT, SLOW_COMPILE, SLOW_RENDER, SLOW_STEPS,  # noqa: E402
                                STEP_FAULT)
from tests.server_utils import API_KEY, KV_BLOCKS, PROMPT, rss_bytes, tiny_server_args, wait_idle  # noqa: E402
from tests.test_server_bad_input import CATALOGUE, MAX_BODY, MAX_SEQS, MAX_WAITING, send  # noqa: E402
from tests.test_server_hostile import CASES as HOSTILE_CASES  # noqa: E402
from tests.test_server_hostile import SECRET  # noqa: E402

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
    max_stall_s: float | None = None     # round three: the largest gap another client's stream saw
    mb_per_client: float | None = None   # round three: RSS added per client of the case


def kv_blocks(http: httpx.Client) -> int:
    return round(wait_idle(http)["pagedserve:kv_cache_usage_perc"] * KV_BLOCKS)


def run_case(srv: ServerProcess, http: httpx.Client, group: str, name: str, expected: set[int],
             call: Callable[[], int | None], health_expected: int = 200, check_kv: bool = True) -> CaseResult:
    """`check_kv` False: another client holds blocks meanwhile (round three checks them at its end)."""
    before_kv, before_rss = kv_blocks(http) if check_kv else 0, rss_bytes(srv.proc.pid)
    start = time.monotonic()
    try:
        status = call()
    except httpx.HTTPError as e:
        status = None
        print(f"  {name}: {type(e).__name__}: {e}", file=sys.stderr)
    seconds = time.monotonic() - start
    health = srv.health()
    alive = srv.proc.poll() is None
    after_kv = kv_blocks(http) if alive and health == 200 and check_kv else before_kv
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


class Bystander:
    """Another client, streaming normal completions (token-id prompts) one after another while the
    cases run; `stall(start, end)` is the largest gap between its chunks in that window."""

    def __init__(self, url: str, prompt_ids: list[int]) -> None:
        self.url, self.prompt_ids = url, prompt_ids
        self.arrivals: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "Bystander":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(60)

    def _run(self) -> None:
        body = {"prompt": self.prompt_ids, "max_tokens": 200, "stream": True, **GREEDY}
        with httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as http:
            while not self._stop.is_set():
                try:
                    with http.stream("POST", "/v1/completions", json=body) as r:
                        for line in r.iter_lines():
                            if line:
                                self.arrivals.append(time.monotonic())
                            if self._stop.is_set():
                                break
                except httpx.HTTPError:
                    time.sleep(0.1)

    def stall(self, start: float, end: float) -> float:
        times = [start] + [t for t in self.arrivals if start <= t <= end] + [end]
        return max(b - a for a, b in zip(times, times[1:]))


def round_three_cases(model: str, tmp: Path, quick: bool) -> list[CaseResult]:
    srv = launch_server(model, tiny_server_args(
        "--api-key", API_KEY, "--shutdown-timeout", "0", "--structured-outputs-compile-timeout", "2"),
        tmp / "round3.log", module="tests.fault_server")
    out: list[CaseResult] = []
    try:
        with httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as http:
            ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]

            def post(path: str, body: dict) -> Callable[[], int]:
                return lambda: http.post(path, json=body).status_code
            hostile = [c for c in HOSTILE_CASES if c[2] is not None]
            if quick:
                hostile = hostile[::3]
            cases = [("round3", name, {400}, post("/v1/chat/completions", body)) for name, body, _ in hostile]
            cases += [
                ("round3", "stream-" + hostile[0][0], {400},
                 post("/v1/chat/completions", {**hostile[0][1], "stream": True})),
                ("round3", "100k-empty-messages", {400}, post("/v1/chat/completions", {
                    "messages": [{"role": "user", "content": ""}] * 100_000, "max_tokens": 1})),
                # (a grammar of its own: the hostile cases' compile-over-the-time-limit sends
                # SLOW_COMPILE's, whose failure the compiler caches, and this one answered from there)
                ("round3", "compile-stuck-past-the-limit", {400}, post("/v1/chat/completions", {
                    "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                    "structured_outputs": {"grammar": f'root ::= "{SLOW_COMPILE}-stuck"'}})),
            ]

            def salted_leak() -> int:
                http.post("/v1/completions", json={"prompt": SECRET, "max_tokens": 2, "cache_salt": "t"})
                snap = http.get("/v1/kv/snapshot")
                return 451 if "zebra" in snap.text else snap.status_code
            cases.append(("round3", "salted-prompt-via-the-dashboard", {200}, salted_leak))
            with Bystander(srv.url, ids) as bystander:
                time.sleep(1.0)
                for case in cases:
                    start = time.monotonic()
                    result = run_case(srv, http, *case, check_kv=False)
                    result.max_stall_s = bystander.stall(start, time.monotonic())
                    out.append(result)
                enums = 2 if quick else 8
                start = time.monotonic()

                def distinct_enums() -> int:
                    statuses = [http.post("/v1/chat/completions", json={
                        "messages": [{"role": "user", "content": "pick"}], "max_tokens": 2,
                        "structured_outputs": {"json": {"enum": [f"v{k}-{i}" for i in range(5000)]}}}).status_code
                        for k in range(enums)]
                    return max(statuses)
                result = run_case(srv, http, "round3", f"{enums}-distinct-5000-value-enums", {200}, distinct_enums,
                                  check_kv=False)
                result.max_stall_s = bystander.stall(start, time.monotonic())
                result.mb_per_client = (result.rss_mb_after - result.rss_mb_before) / enums
                out.append(result)
            # With the streaming client gone: nothing is held, and the log has no traceback.
            out.append(run_case(srv, http, "round3", "nothing-held-afterwards", {200},
                                lambda: 200 if "Traceback" not in srv.log() else 500))
    finally:
        srv.stop()
    out.append(sigterm_case(model, tmp))
    return out


def sigterm_case(model: str, tmp: Path) -> CaseResult:
    """SIGTERM with a stuck compile, a stuck render and a stream in flight: each is answered 503
    and the server exits 0; `seconds` is the time from the signal to the exit."""
    srv = launch_server(model, tiny_server_args("--shutdown-timeout", "1"), tmp / "sigterm.log",
                        module="tests.fault_server")
    statuses: dict[str, int | None] = {}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

    def post(name: str, body: dict) -> None:
        try:
            statuses[name] = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=120).status_code
        except httpx.HTTPError:
            statuses[name] = None
    first_chunk = threading.Event()

    def stream() -> None:
        body = {"prompt": f"{SLOW_STEPS} {PROMPT}", "max_tokens": 400, "stream": True, **GREEDY}
        try:
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=120) as r:
                lines = []
                for line in r.iter_lines():
                    first_chunk.set()
                    lines.append(line)
                statuses["stream"] = 503 if any("service_unavailable" in line for line in lines) else r.status_code
        except httpx.HTTPError:
            statuses["stream"] = None
    rss = rss_bytes(srv.proc.pid) / 2**20
    threads = [threading.Thread(target=stream)]
    threads[0].start()
    first_chunk.wait(60)
    threads += [threading.Thread(target=post, args=("compile", {**chat, "structured_outputs": {
                    "grammar": f'root ::= "{SLOW_COMPILE}"'}})),
                threading.Thread(target=post, args=("render", {**chat, "messages": [
                    {"role": "user", "content": SLOW_RENDER}]}))]
    for t in threads[1:]:
        t.start()
    time.sleep(0.5)
    signalled = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    try:
        code = srv.proc.wait(60)
    except subprocess.TimeoutExpired:
        code = None
    seconds = time.monotonic() - signalled
    for t in threads:
        t.join(60)
    srv.stop()
    passed = code == 0 and statuses.get("compile") == statuses.get("render") == statuses.get("stream") == 503
    return CaseResult("round3", f"sigterm-exit (503s: {statuses})", "exit 0", code, passed, seconds, 0, 0, rss, 0.0,
                      None)


def print_table(results: list[CaseResult]) -> None:
    print(f"{'case':<48} {'ok':<4} {'want':>7} {'got':>4} {'time s':>8} {'KV before':>9} {'KV after':>8} "
          f"{'RSS MB before':>13} {'RSS MB after':>12}")
    for r in results:
        print(f"{r.group + '/' + r.name:<48} {'pass' if r.passed else 'FAIL':<4} {r.expected:>7} "
              f"{str(r.status):>4} {r.seconds:8.3f} {r.kv_blocks_before:9d} {r.kv_blocks_after:8d} "
              f"{r.rss_mb_before:13.1f} {r.rss_mb_after:12.1f}")
    stalls = [r for r in results if r.max_stall_s is not None]
    if stalls:
        worst = max(stalls, key=lambda r: r.max_stall_s)
        print(f"\nround three: the largest stall another client saw: {worst.max_stall_s:.3f} s ({worst.name})")
        for r in results:
            if r.mb_per_client is not None:
                print(f"round three: {r.name}: {r.mb_per_client:.1f} MB of RSS per client")
            if r.name.startswith("sigterm-exit"):
                print(f"round three: exit {r.seconds:.2f} s after SIGTERM (--shutdown-timeout 1)")
    failed = [r.name for r in results if not r.passed]
    print(f"\n{len(results) - len(failed)}/{len(results)} cases passed" + (f"; failed: {failed}" if failed else ""))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--quick", action="store_true", help="round three only, a third of its cases")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model = make_tiny_model(tmp, "llama_gqa_untied", build_tokenizer()).path
        results = [] if args.quick else catalogue_cases(model, tmp) + fault_cases(model, tmp)
        results += round_three_cases(model, tmp, args.quick)
    print_table(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": "tests' tiny llama_gqa_untied (random weights)",
                                    "cases": [asdict(r) for r in results]}, indent=1))
    print(f"wrote {args.out}")
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
