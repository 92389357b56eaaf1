"""Start `pagedserve serve` as a subprocess on a free local port, wait until it is ready,
and stop it with SIGTERM: for the tests and the serving benchmark."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from pagedserve.distributed.group import free_port


@dataclass
class ServerProcess:
    proc: subprocess.Popen
    url: str                 # http://host:port
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def health(self) -> int | None:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except OSError:
            return None

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            if self.health() == 200:
                return
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"the server was not ready after {timeout} s:\n{self.log()[-4000:]}")

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, then wait; SIGKILL only if it does not exit. Returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def __enter__(self) -> "ServerProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def launch_server(model: str | None, args: list[str], log_path: str | Path, host: str = "127.0.0.1",
                  port: int | None = None, env: dict | None = None, wait: bool = True,
                  timeout: float = 180.0, module: str = "pagedserve.cli") -> ServerProcess:
    """`python -m <module> serve ...`: `module` is the CLI, or a test's wrapper of it."""
    port = port or free_port(host)
    cmd = [sys.executable, "-m", module, "serve", *([model] if model else []),
           "--host", host, "--port", str(port), *args]
    log_path = Path(log_path)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    server = ServerProcess(proc, f"http://{host}:{port}", log_path)
    if wait:
        server.wait_ready(timeout)
    return server
