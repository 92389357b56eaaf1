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
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from pagedserve.structured.params import StructuredOutputsParams
from pagedserve.utils import cdiv

BITS = 32


def bitmask_width(vocab_size: int) -> int:
    """int32 words per row of a token bitmask."""
    return cdiv(vocab_size, BITS)


class GrammarCompiler:
    """Compiles constraints against one tokenizer's vocabulary, in `num_threads` threads, with
    the results cached by the constraint's text (max_cached most recent kept)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int], num_threads: int = 2,
                 max_cached: int = 256) -> None:
        import xgrammar as xgr
        self._xgr = xgr
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self._tokenizer = tokenizer
        self._compiler = None     # xgrammar's, over its view of the vocabulary: built on a pool thread
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="pagedserve-grammar")
        self._cache: dict[tuple[str, str], Future] = {}
        self._max_cached = max_cached
        self._lock = threading.Lock()            # the cache (engine thread, briefly)
        self._build_lock = threading.Lock()      # the xgrammar compiler (pool threads)
        self.on_ready: Callable[[], None] = lambda: None   # called (on a pool thread) when a compile ends
        self.num_compiles = 0

    def compile(self, params: StructuredOutputsParams) -> Future:
        """The compiled grammar's future (cached by the constraint's text)."""
        key = params.key
        with self._lock:
            future = self._cache.pop(key, None)
            if future is None or (future.done() and future.exception() is not None):
                future = self._pool.submit(self._compile, params.grammar_text())
                future.add_done_callback(lambda _: self.on_ready())
                self.num_compiles += 1
            self._cache[key] = future          # most recently used last
            while len(self._cache) > self._max_cached:
                del self._cache[next(iter(self._cache))]
        return future

    def _compile(self, ebnf: str):
        return self._xgrammar_compiler().compile_grammar(self._xgr.Grammar.from_ebnf(ebnf))

    def _xgrammar_compiler(self):
        """Built by the first compile (reading the vocabulary takes a while), not on the engine thread."""
        with self._build_lock:
            if self._compiler is None:
                xgr = self._xgr
                info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def new_state(self, params: StructuredOutputsParams) -> "StructuredState":
        return StructuredState(self.compile(params), self.stop_token_ids, bitmask_width(self.vocab_size))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class StructuredState:
    """One request's constraint: the compiled grammar (once its future is done) and a matcher
    per sequence, keyed by seq id, with the number of output tokens each has accepted."""

    def __init__(self, compiled: Future, stop_token_ids: list[int], width: int) -> None:
        self.compiled = compiled
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
        if not m.accept_token(token):
            raise RuntimeError(f"the sampled token {token} does not match the grammar")
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
