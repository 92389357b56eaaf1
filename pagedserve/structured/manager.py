"""Grammars compiled off the engine thread, and one matcher per constrained sequence.

`GrammarCompiler` compiles a request's constraint against the model's vocabulary in a thread
pool and caches the result by the constraint's text (a second request with the same schema
reuses the first's compile, even while it is still running), so a step never waits for a
compile. `StructuredState` is a request's part: the compile's future, then one xgrammar
matcher per live sequence. The scheduler advances a sequence's matcher on each token it
appends (`accept`), forks it with the sequence, and asks for the step's token bitmask
(`fill_bitmask`): packed int32 rows, one bit per token id, that travel to the worker in the
StepBatch as plain data; the sampler applies them before sampling.

A matcher's state is a function of the sequence's output tokens: each state counts the tokens
its matcher accepted, and one that falls out of step with its sequence is rebuilt by replaying
them (preemption by recompute keeps a sequence's tokens, so its matcher stays valid).
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from pagedserve.errors import InvalidRequestError
from pagedserve.structured.params import StructuredOutputsParams
from pagedserve.utils import cdiv
from pagedserve.structured.compile_process import CompileJob, CompileProcesses, TrialFailed, TrialTimeout
from pagedserve.structured.pool import CompilePool, Task

BITS = 32
ENTRY_OVERHEAD = 512          # bytes of an entry's own bookkeeping, besides its key and grammar
MAX_ENTRIES = 4096            # cached constraints (failed ones too), whatever their bytes


def bitmask_width(vocab_size: int) -> int:
    """int32 words per row of a token bitmask."""
    return cdiv(vocab_size, BITS)


@dataclass(eq=False)
class _Entry:
    """A constraint's compile: its future (the CompiledGrammar), the requests using it, and its
    bytes: the key's text, plus xgrammar's memory_size_bytes once compiled."""
    key: tuple[str, str]
    future: Future
    task: Task | None = None
    job: CompileJob | None = None   # its trial compile (a child process), which release() kills
    users: int = 0
    nbytes: int = 0
    cached: bool = True          # in the cache (its bytes counted)


class GrammarCompiler:
    """Compiles constraints against one tokenizer's vocabulary on a CompilePool (building the
    grammar text there too: converting a schema is proportional to its size), with the results
    cached by the constraint's text, least recently used evicted past `max_cache_bytes`.

    Limits: `compile_timeout` seconds per compile, enforced by a trial compile in a child process
    that is killed past it (compile_process.py; then the request fails with a 400-kind
    InvalidRequestError); without a limit, compiles run in this process only;
    `max_grammar_bytes` of grammar text per constraint; a grammar that matches no text at all is
    refused once compiled. A compile whose every request has gone (`release`) is abandoned."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int], num_threads: int = 2,
                 max_cache_bytes: int = 256 << 20, compile_timeout: float | None = 10.0,
                 max_grammar_bytes: int | None = 256 << 10) -> None:
        import xgrammar as xgr
        self._xgr = xgr
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self._tokenizer = tokenizer
        self._compiler = None     # xgrammar's, over its view of the vocabulary: built on a pool thread
        self.compile_timeout = compile_timeout if compile_timeout and compile_timeout > 0 else None
        self.max_grammar_bytes = max_grammar_bytes if max_grammar_bytes and max_grammar_bytes > 0 else None
        self._pool = CompilePool(num_threads)
        self._processes: CompileProcesses | None = None   # the trial compiles' children, with the compiler
        self._num_threads = num_threads
        self._closed = False
        self._cache: dict[tuple[str, str], _Entry] = {}   # least recently used first
        self.max_cache_bytes = max_cache_bytes
        self.cache_bytes = 0
        self._lock = threading.Lock()            # the cache (engine thread, briefly; pool threads)
        self._build_lock = threading.Lock()      # the xgrammar compiler (pool threads)
        self.on_ready: Callable[[], None] = lambda: None   # called (on a pool thread) when a compile ends
        self.num_compiles = 0

    @property
    def num_cached(self) -> int:
        with self._lock:
            return sum(1 for e in self._cache.values() if e.future.done() and e.nbytes)

    def compile(self, params: StructuredOutputsParams) -> Future:
        """The compiled grammar's future (cached by the constraint's text)."""
        return self._acquire(params).future

    def _acquire(self, params: StructuredOutputsParams) -> _Entry:
        key = params.key
        with self._lock:
            entry = self._cache.pop(key, None)
            # A failed compile is tried again, unless the constraint itself is at fault (too large,
            # too slow, matches nothing): a repeat of it is refused at once.
            if entry is not None and entry.future.done() and entry.future.exception() is not None \
                    and not isinstance(entry.future.exception(), InvalidRequestError):
                self._forget(entry)
                entry = None
            if entry is None:
                entry = _Entry(key, Future(), job=CompileJob(),
                               nbytes=len(key[0]) + len(key[1]) + ENTRY_OVERHEAD)
                self.cache_bytes += entry.nbytes
                entry.task = self._pool.submit(lambda e=entry: self._build(params, e))
                entry.future = entry.task.future
                entry.future.add_done_callback(lambda _: self.on_ready())
                self.num_compiles += 1
            entry.users += 1
            if entry.cached:
                self._cache[key] = entry          # most recently used last
                self._evict()
        return entry

    def release(self, entry: _Entry) -> None:
        """A request using the entry has ended; a compile nobody waits for any more is abandoned
        (dropped from the queue; its trial compile's child killed; a compile in this process
        left to finish as an orphan, its result dropped)."""
        with self._lock:
            entry.users -= 1
            abandon = entry.users <= 0 and not entry.future.done()
            if abandon:
                self._forget(entry)
        if abandon and entry.job is not None:
            entry.job.cancel()
        if abandon and entry.task is not None:
            self._pool.abandon(entry.task, RuntimeError("the grammar compile was abandoned: its requests ended"))

    def _forget(self, entry: _Entry) -> None:
        """(Lock held.) Out of the cache."""
        if self._cache.get(entry.key) is entry:
            del self._cache[entry.key]
        if entry.cached:
            self.cache_bytes -= entry.nbytes
        entry.cached = False

    def _count(self, entry: _Entry, compiled) -> None:
        """(Pool thread, before the future is answered.) Count the entry's bytes and evict the
        least recently used compiled grammars past max_cache_bytes (requests holding one keep
        it: only the cache's reference goes)."""
        with self._lock:
            if not entry.cached or entry.future.done():   # abandoned, timed out
                return
            grammar_bytes = _grammar_bytes(compiled)
            entry.nbytes += grammar_bytes
            self.cache_bytes += grammar_bytes
            self._evict(finishing=entry)

    def _evict(self, finishing: _Entry | None = None) -> None:
        """(Lock held.) Least recently used first, drop finished entries (and `finishing`, about
        to finish) while the cache is over its bytes or MAX_ENTRIES; a compile still running
        stays (its requests wait for it)."""
        for old in list(self._cache.values()):
            if self.cache_bytes <= self.max_cache_bytes and len(self._cache) <= MAX_ENTRIES:
                return
            if old is finishing or old.future.done():
                self._forget(old)

    def _build(self, params: StructuredOutputsParams, entry: _Entry):
        """(Pool thread.) Grammar text, size check, compile, and the check that it matches something."""
        text = params.grammar_text()
        if self.max_grammar_bytes is not None and len(text) > self.max_grammar_bytes:
            raise InvalidRequestError(
                f"the constraint is too large: its grammar is {len(text)} bytes and the limit is "
                f"{self.max_grammar_bytes} (--structured-outputs-max-grammar-bytes)", "structured_outputs")
        compiled = self._compile(text, entry.job)
        if not _matches_something(compiled, self.vocab_size, self.stop_token_ids):
            raise InvalidRequestError(f"the {params.kind} matches no text: no token can start it and it cannot end "
                                      f"empty (e.g. a rule that only refers to itself)",
                                      f"structured_outputs.{params.kind}")
        self._count(entry, compiled)
        return compiled

    def _compile(self, ebnf: str, job: CompileJob | None = None):
        """(Pool thread.) With a time limit: the trial compile in a child process first (killed
        past the limit), then the compile here, which takes what the trial took."""
        try:
            grammar = self._xgr.Grammar.from_ebnf(ebnf)
        except (RuntimeError, ValueError) as e:
            raise InvalidRequestError(f"invalid grammar: {e}", "structured_outputs") from None
        compiler = self._xgrammar_compiler()
        if self.compile_timeout is not None:
            try:
                self._processes.trial(ebnf, self.compile_timeout, job or CompileJob())
            except TrialTimeout:
                raise _timeout_error(self.compile_timeout) from None
            except TrialFailed as e:
                raise InvalidRequestError(f"the grammar did not compile: {e}", "structured_outputs") from None
        return compiler.compile_grammar(grammar)

    def _xgrammar_compiler(self):
        """Built by the first compile (reading the vocabulary takes a while), not on the engine
        thread; with it, the trial compiles' child processes (over the same vocabulary)."""
        with self._build_lock:
            if self._compiler is None:
                xgr = self._xgr
                info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids)
                if self.compile_timeout is not None:
                    self._processes = CompileProcesses(info.serialize_json(), max_idle=self._num_threads)
                    if self._closed:
                        self._processes.close()
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def warm(self) -> Future:
        """Build xgrammar's compiler over the vocabulary and start a trial compile's child now, on
        a pool thread (the child starts on one of its own), so that the first structured request
        waits for neither (engine start: LLMEngine's structured_outputs_warmup)."""
        def build() -> None:
            self._xgrammar_compiler()
            if self._processes is not None:
                self._processes.prestart()
        return self._pool.submit(build).future

    @property
    def processes(self) -> CompileProcesses | None:
        """The trial compiles' children (None before the first compile or warm-up, or without a limit)."""
        return self._processes

    def new_state(self, params: StructuredOutputsParams) -> "StructuredState":
        entry = self._acquire(params)
        return StructuredState(entry.future, self.stop_token_ids, bitmask_width(self.vocab_size),
                               release=lambda: self.release(entry))

    def close(self) -> None:
        """Fail every queued and running compile now (shutdown); the threads never hold the exit."""
        self._pool.close(RuntimeError("the grammar compile was cancelled: the server is shutting down"))
        self._closed = True
        if self._processes is not None:     # (one built after this closes itself: _xgrammar_compiler)
            self._processes.close()


def _timeout_error(seconds: float) -> InvalidRequestError:
    return InvalidRequestError(f"compiling the constraint took longer than the time limit of {seconds:g} s "
                               f"(--structured-outputs-compile-timeout); simplify the schema, regex or grammar",
                               "structured_outputs")


def _grammar_bytes(compiled) -> int:
    """What a compiled grammar costs in memory, as xgrammar measures it."""
    try:
        return int(compiled.memory_size_bytes)
    except (AttributeError, TypeError):
        return 1 << 20


def _matches_something(compiled, vocab_size: int, stop_token_ids: list[int]) -> bool:
    """The grammar's start allows some token (a stop token where it may end empty)."""
    import xgrammar as xgr
    matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stop_token_ids)
    bitmask = np.zeros((1, bitmask_width(vocab_size)), dtype=np.int32)
    matcher.fill_next_token_bitmask(bitmask, 0)
    return bool(bitmask.any()) or matcher.is_terminated()


class StructuredState:
    """One request's constraint: the compiled grammar (once its future is done) and a matcher
    per sequence, keyed by seq id, with the number of output tokens each has accepted."""

    def __init__(self, compiled: Future, stop_token_ids: list[int], width: int,
                 release: Callable[[], None] = lambda: None) -> None:
        self.compiled = compiled
        self._release: Callable[[], None] | None = release
        self.stop_token_ids = stop_token_ids
        self.width = width                 # int32 words per bitmask row
        self.matchers: dict[int, object] = {}
        self.num_accepted: dict[int, int] = {}

    @property
    def ready(self) -> bool:
        """The grammar is compiled (or failed to: `error` says why)."""
        return self.compiled.done()

    @property
    def error(self) -> BaseException | None:
        return self.compiled.exception() if self.compiled.done() else None

    def matcher(self, seq_id: int, output_token_ids: list[int]):
        """The sequence's matcher, created (or rebuilt) to have accepted exactly its output tokens."""
        m = self.matchers.get(seq_id)
        if m is not None and self.num_accepted[seq_id] == len(output_token_ids):
            return m
        import xgrammar as xgr
        m = xgr.GrammarMatcher(self.compiled.result(), override_stop_tokens=self.stop_token_ids)
        for token in output_token_ids:
            if not m.accept_token(token):
                raise RuntimeError(f"replaying the output: the grammar refuses token {token}")
        self.matchers[seq_id] = m
        self.num_accepted[seq_id] = len(output_token_ids)
        return m

    def accept(self, seq_id: int, output_token_ids: list[int]) -> bool:
        """The sequence's last output token is accepted by its matcher; returns whether the
        grammar has ended (the matcher terminated: it accepted a stop token, or nothing may follow)."""
        m = self.matcher(seq_id, output_token_ids[:-1])
        token = output_token_ids[-1]
        if not m.accept_token(token):   # the grammar allowed no token here (it leads nowhere)
            raise InvalidRequestError("the constraint's grammar allows no continuation of the output here "
                                      "(it has a dead end); fix the grammar", "structured_outputs")
        self.num_accepted[seq_id] += 1
        return m.is_terminated()

    def fork(self, parent_id: int, child_id: int) -> None:
        m = self.matchers.get(parent_id)
        if m is not None:
            self.matchers[child_id] = m.fork()
            self.num_accepted[child_id] = self.num_accepted[parent_id]

    def drop(self, seq_id: int) -> None:
        self.matchers.pop(seq_id, None)
        self.num_accepted.pop(seq_id, None)

    def release(self) -> None:
        """The request has ended (finished, aborted): a compile it alone waited for is abandoned."""
        self.matchers.clear()
        self.num_accepted.clear()
        release, self._release = self._release, None
        if release is not None:
            release()


_batch_matcher = None


def fill_bitmask(rows: list[tuple[StructuredState, int, list[int]]]) -> np.ndarray:
    """A step's token bitmask, one row per (state, seq id, output token ids) of a constrained
    sequence that samples: [len(rows), width] int32, bit t of a row set where the sequence may
    sample token t. Rows are filled by xgrammar (in C++, one thread: the cores run the model)."""
    global _batch_matcher
    width = rows[0][0].width
    bitmask = np.full((len(rows), width), -1, dtype=np.int32)
    matchers = [state.matcher(seq_id, output) for state, seq_id, output in rows]
    if len(matchers) == 1:
        matchers[0].fill_next_token_bitmask(bitmask, 0)
    else:
        if _batch_matcher is None:
            import xgrammar as xgr
            _batch_matcher = xgr.BatchGrammarMatcher(max_threads=1)
        _batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask)
    return bitmask
