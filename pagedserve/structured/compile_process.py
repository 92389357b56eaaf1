"""Trial compiles in child processes, which a time limit can kill.

xgrammar's compile cannot be interrupted inside a process, so a grammar is first compiled in a
child process (`python -P compile_process.py`: xgrammar only, none of the engine) under the hard
time limit: past it, or once no request wants the grammar any more, the child is killed
(SIGKILL) and replaced, and the compile is gone with it. A grammar whose trial compile ended in
time is then compiled again in the engine's process (its pool thread), which takes the time the
trial took: the compile is deterministic, so what runs unkillable in the engine is bounded by the
limit. The compiled grammar is not carried back: xgrammar 0.2.9's `CompiledGrammar.serialize_json`
writes about 20 times the grammar's memory as JSON (300 string properties: a 0.13 s compile
serialised in 4.0 s to 19.8 MB, read back in 1.4 s), so compiling twice costs less.

Protocol (length-prefixed frames on the child's stdin / stdout): the parent sends the
tokenizer's `TokenizerInfo.serialize_json()`, the child answers "ready"; then per compile the
parent sends the EBNF text and the child answers "ok" or "error:<message>".
"""
from __future__ import annotations

import os
import select
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

_HEADER = struct.Struct(">Q")
START_TIMEOUT = 120.0      # seconds a child may take to start (it imports xgrammar, and with it torch)
MAX_FRAME = 64 << 20       # the largest frame either side accepts


class TrialTimeout(Exception):
    """The trial compile ran past its time limit (the child was killed)."""


class TrialFailed(Exception):
    """The grammar did not compile in the child (xgrammar's error, or the child died on it)."""


@dataclass(eq=False)
class CompileJob:
    """One trial compile, which `cancel()` stops from any thread (its child is killed)."""
    cancelled: bool = False
    _child: "ChildProcess | None" = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def cancel(self) -> None:
        with self._lock:
            self.cancelled = True
            child = self._child
        if child is not None:
            child.kill()

    def _attach(self, child: "ChildProcess | None") -> bool:
        """Record the child running the job; False if the job was cancelled already."""
        with self._lock:
            self._child = child
            return not self.cancelled


class ChildProcess:
    """One child process holding xgrammar's compiler over the tokenizer's vocabulary."""

    def __init__(self, tokenizer_info_json: str, wait: bool = True) -> None:
        """Start the child; `wait`: until it is ready (else call wait_ready())."""
        env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        self.proc = subprocess.Popen([sys.executable, "-P", __file__], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, start_new_session=True)
        try:
            _write(self.proc.stdin, tokenizer_info_json.encode())
        except BaseException:
            self.close()
            raise
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Until the child has imported xgrammar and read the vocabulary (killed meanwhile: it raises)."""
        try:
            if _read(self.proc.stdout.fileno(), time.monotonic() + START_TIMEOUT) != b"ready":
                raise RuntimeError("the grammar compile process did not start")
        except BaseException:
            self.close()
            raise

    @property
    def pid(self) -> int:
        return self.proc.pid

    def compile(self, ebnf: str, timeout: float | None) -> None:
        """The trial compile; raises TrialTimeout past `timeout` seconds (the caller kills the
        child), TrialFailed if xgrammar refused the grammar or the child died."""
        try:
            _write(self.proc.stdin, ebnf.encode())
            answer = _read(self.proc.stdout.fileno(), None if timeout is None else time.monotonic() + timeout)
        except (OSError, EOFError, ValueError):
            raise TrialFailed(f"the compile process ended (exit status {self.proc.poll()})") from None
        if answer is None:
            raise TrialTimeout()
        if answer != b"ok":
            raise TrialFailed(answer.decode(errors="replace").removeprefix("error:"))

    def kill(self) -> None:
        """SIGKILL and reap (any thread; idempotent). The pipes stay open: the thread using the
        child reads the end of its output, then calls close()."""
        try:
            self.proc.kill()
        except OSError:
            pass
        self.proc.wait()

    def close(self) -> None:
        """Kill, then close the pipes (only the thread that owns the child)."""
        self.kill()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except OSError:
                pass


class CompileProcesses:
    """The child processes trial compiles run in: one per concurrent compile, idle ones kept
    (at most `max_idle`) for the next; a killed one is replaced at once, in the background."""

    def __init__(self, tokenizer_info_json: str, max_idle: int = 2) -> None:
        self._info = tokenizer_info_json
        self.max_idle = max_idle
        self._lock = threading.Condition()
        self._idle: list[ChildProcess] = []
        self._starting = 0            # spares being started in the background
        self._spawned: set[ChildProcess] = set()   # those of them whose process exists, not yet ready
        self._busy: set[ChildProcess] = set()
        self._closed = False

    def trial(self, ebnf: str, timeout: float | None, job: CompileJob) -> None:
        """Compile `ebnf` in a child within `timeout` seconds (from when the child has it);
        raises TrialTimeout, TrialFailed, or RuntimeError if the job was cancelled."""
        child = self._take()
        if not job._attach(child):
            self._give_back(child)
            raise RuntimeError("the grammar compile was abandoned")
        try:
            child.compile(ebnf, timeout)
        except TrialTimeout:
            self._discard(child)
            raise
        except TrialFailed:
            self._discard(child)
            if job.cancelled:
                raise RuntimeError("the grammar compile was abandoned") from None
            raise
        finally:
            job._attach(None)
        self._give_back(child)

    @property
    def pids(self) -> list[int]:
        """The children's process ids, idle, busy and starting (for tests and the log)."""
        with self._lock:
            return [c.pid for c in self._idle] + [c.pid for c in self._busy] + [c.pid for c in self._spawned]

    @property
    def idle_pids(self) -> list[int]:
        """The ready children's waiting for a compile."""
        with self._lock:
            return [c.pid for c in self._idle]

    def prestart(self) -> None:
        """Start a child in the background now, unless one is ready or starting (the engine's
        warm-up: the first compile then finds it, or waits for it rather than start another)."""
        with self._lock:
            if self._closed or self._idle or self._starting:
                return
            self._starting += 1
        threading.Thread(target=self._start_spare, name="pagedserve-grammar-spare", daemon=True).start()

    def _take(self) -> ChildProcess:
        with self._lock:
            while self._starting and not self._idle and not self._closed:   # a spare is on its way
                self._lock.wait()
            if self._closed:
                raise RuntimeError("the grammar compiler is shut down")
            child = self._idle.pop() if self._idle else None
        if child is None:
            child = ChildProcess(self._info)
        with self._lock:
            closed = self._closed
            if not closed:
                self._busy.add(child)
        if closed:
            child.close()
            raise RuntimeError("the grammar compiler is shut down")
        return child

    def _give_back(self, child: ChildProcess) -> None:
        with self._lock:
            self._busy.discard(child)
            keep = not self._closed and len(self._idle) < self.max_idle
            if keep:
                self._idle.append(child)
                self._lock.notify_all()
        if not keep:
            child.close()

    def _discard(self, child: ChildProcess) -> None:
        """Kill the child (its compile with it) and start a replacement in the background."""
        with self._lock:
            self._busy.discard(child)
            spare = not self._closed and len(self._idle) + self._starting < self.max_idle
            if spare:
                self._starting += 1
        child.close()
        if spare:
            threading.Thread(target=self._start_spare, name="pagedserve-grammar-spare", daemon=True).start()

    def _start_spare(self) -> None:
        child, ready = None, False
        try:
            child = ChildProcess(self._info, wait=False)
            with self._lock:   # close() kills it from here on
                self._spawned.add(child)
                closed = self._closed
            if not closed:
                child.wait_ready()
                ready = True
        except Exception:   # noqa: BLE001 - the next compile starts one itself (and reports why not)
            pass
        with self._lock:       # handed over in the same breath: a waiting _take sees it
            self._spawned.discard(child)
            self._starting -= 1
            keep = ready and not self._closed and len(self._idle) < self.max_idle
            if keep:
                self._idle.append(child)
            self._lock.notify_all()
        if child is not None and not keep:
            child.close()

    def close(self) -> None:
        """Kill every child, busy ones too (their compiles fail; their threads close them)."""
        with self._lock:
            self._closed = True
            idle, busy = list(self._idle), list(self._busy) + list(self._spawned)
            self._idle.clear()
            self._lock.notify_all()
        for child in idle:
            child.close()
        for child in busy:     # (a starting one's thread closes it)
            child.kill()


# ---- frames -----------------------------------------------------------------------------------
def _write(stream, payload: bytes) -> None:
    stream.write(_HEADER.pack(len(payload)) + payload)
    stream.flush()


def _read(fd: int, deadline: float | None) -> bytes | None:
    """One frame from `fd`; None past `deadline` (time.monotonic()); EOFError at the end."""
    buf = b""
    need = _HEADER.size
    header_done = False
    while True:
        while len(buf) < need:
            wait = None if deadline is None else deadline - time.monotonic()
            if wait is not None and wait <= 0:
                return None
            ready, _, _ = select.select([fd], [], [], wait)
            if not ready:
                return None
            chunk = os.read(fd, max(need - len(buf), 1 << 16))
            if not chunk:
                raise EOFError
            buf += chunk
        if header_done:
            return buf
        (length,) = _HEADER.unpack(buf[:_HEADER.size])
        if length > MAX_FRAME:
            raise ValueError(f"a frame of {length} bytes")
        buf, need, header_done = buf[_HEADER.size:], length, True


# ---- the child ----------------------------------------------------------------------------------
def _child_main() -> None:
    import xgrammar as xgr
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr       # nothing else may write into the frames

    def read() -> bytes:
        header = inp.read(_HEADER.size)
        if len(header) < _HEADER.size:
            raise SystemExit(0)   # the parent closed the pipe (or exited)
        (length,) = _HEADER.unpack(header)
        return inp.read(length)

    info = xgr.TokenizerInfo.deserialize_json(read().decode())
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    _write(out, b"ready")
    while True:
        ebnf = read().decode()
        try:
            compiler.compile_grammar(xgr.Grammar.from_ebnf(ebnf))
            answer = b"ok"
        except Exception as e:   # noqa: BLE001 - the parent reports it as the request's error
            answer = b"error:" + str(e).encode()[:4096]
        _write(out, answer)


if __name__ == "__main__":
    try:
        _child_main()
    except (BrokenPipeError, KeyboardInterrupt):   # the parent went away (or was interrupted)
        os._exit(0)
