"""AsyncLLM: one LLMEngine run by one background thread, for the server.

The engine is not thread-safe, so only its own thread ever touches it: it
builds the engine, then loops over (apply queued adds/aborts, run one step,
hand the outputs out). Callers on the asyncio event loop never call the
engine; they put commands on a thread-safe queue and wake the thread, and
each caller reads its outputs from its own asyncio queue, filled by the event
loop from call_soon_threadsafe callbacks. With nothing to do the thread
sleeps on an Event instead of spinning.

Every HTTP request's prompts join the same running batch: continuous
batching across clients comes from the scheduler seeing all of them.
The KV dashboard's snapshots are commands too (`kv_capture`): the engine
thread copies the cache between two steps and hands the copy back.

No exception ends the thread silently. What a failed step means is the engine's
policy (LLMEngine.recover, which the offline LLM applies too): one raised while
handling a single request's results fails that request (EngineStepError) and the
rest go on; a step that fails as a whole fails every request in flight and starts
the KV bookkeeping afresh; a lost rank or MAX_STEP_FAILURES such steps in a row, or
an exception anywhere else in the loop, mean the engine cannot go on: it is "dead",
every request fails with EngineDeadError, new ones are refused, and wait_dead()
returns (the server then answers 503 and exits non-zero).
"""
from __future__ import annotations

import asyncio
import copy
import dataclasses
import logging
import queue
import threading
import time
import weakref
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from typing import Any, Callable

from pagedserve.config import EngineConfig
from pagedserve.engine.llm_engine import LLMEngine, PromptType
from pagedserve.engine.chat import load_chat_template
from pagedserve.engine.kv_view import EngineCapture, capture
from pagedserve.engine.protocol import Params, QueueFullError, check_num_prompts
from pagedserve.engine.request_checks import RequestLimits, check_given, check_runner, split_prompt
from pagedserve.engine.tokenizer import TokenizerLane, front_end_tokenizer, max_token_chars
from pagedserve.errors import InvalidRequestError
from pagedserve.engine.stats import (FinishedRequestStats, IterationStats, LoggingStatLogger, SchedulerStats,
                                     StatLogger, StatTotals)
from pagedserve.kernels.threads import release_thread_team
from pagedserve.kv.events import KVEventSink
from pagedserve.outputs import CompletionOutput, RequestOutput
from pagedserve.request import Request
from pagedserve.sampling_params import RequestOutputKind

logger = logging.getLogger(__name__)


class EngineNotReadyError(RuntimeError):
    """The engine is still starting, failed to start, or is shutting down."""


class EngineStepError(RuntimeError):
    """The engine failed while running this request (it was dropped; the engine goes on)."""


class EngineDeadError(EngineNotReadyError):
    """The engine thread hit a fault it cannot recover from: every request fails."""


@dataclass
class _Progress:
    """Engine-thread bookkeeping per request, for the stats."""
    num_prompt_tokens: int
    num_tokens: int = 0
    last_token_time: float | None = None


class RequestStream:
    """The outputs of one caller's engine requests (one per prompt), as they come.

    Each output is cumulative (text and token ids so far). Iteration ends when every
    request has finished; close() aborts whatever has not.

    A request's output not taken yet is replaced by its next one (cumulative: the newer holds
    all of it), so a caller that reads slowly (a streaming client that reads nothing: its socket's
    buffers full) pins each request's output once, not one copy per step; its next read gets
    everything since, in one piece. (Event loop only: AsyncLLM delivers with call_soon_threadsafe.)
    """

    def __init__(self, llm: "AsyncLLM", request_ids: list[str]) -> None:
        self._llm = llm
        self.request_ids = list(request_ids)
        self._unfinished = set(request_ids)
        # Request id -> its newest output not taken yet (an error under None), oldest first.
        self._pending: dict[str | None, RequestOutput | BaseException] = {}
        self._ready = asyncio.Event()

    @property
    def finished(self) -> bool:
        return not self._unfinished

    def _put(self, item: RequestOutput | BaseException) -> None:
        key = None if isinstance(item, BaseException) else item.request_id
        if key is not None and key in self._pending:
            del self._pending[key]           # superseded: the newer one goes to the end, in arrival order
        self._pending[key] = item
        self._ready.set()

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._outputs()

    async def _outputs(self) -> AsyncIterator[RequestOutput]:
        while self._unfinished:
            while not self._pending:
                self._ready.clear()
                await self._ready.wait()
            item = self._pending.pop(next(iter(self._pending)))
            if isinstance(item, BaseException):
                self.abort()   # the caller's other requests are of no use now
                self._unfinished.clear()
                raise item
            if item.finished:
                self._unfinished.discard(item.request_id)
            yield item

    def abort(self) -> None:
        """Abort the unfinished requests now; their final outputs (finish_reason "abort")
        still arrive on this stream."""
        if self._unfinished:
            self._llm.abort(sorted(self._unfinished))

    def close(self) -> None:
        """Abort what is unfinished and stop listening (the caller is going away)."""
        self.abort()
        self._unfinished.clear()
        self._llm._unregister(self.request_ids)


def delta_output(c: CompletionOutput, sent: dict[int, tuple[int, int]]) -> CompletionOutput:
    """The part of cumulative output `c` not yielded yet (`sent` remembers, per index)."""
    text_len, num_tokens = sent.get(c.index, (0, 0))
    sent[c.index] = (len(c.text), len(c.token_ids))
    return dataclasses.replace(c, text=c.text[text_len:], token_ids=c.token_ids[num_tokens:],
                               logprobs=c.logprobs[num_tokens:] if c.logprobs is not None else None)


# The engines whose threads run in this process (a multi-model server has one per loaded model):
# while there are several, an idle one hands back its OpenMP workers (kernels/threads.py says why).
_running: "weakref.WeakSet[AsyncLLM]" = weakref.WeakSet()
_running_lock = threading.Lock()


class AsyncLLM:
    """An EngineClient (engine/protocol.py) over one LLMEngine on a thread of its own."""

    def __init__(self, config: EngineConfig, stat_loggers: list[StatLogger] | None = None,
                 log_interval: float | None = 10.0, max_waiting_requests: int | None = None,
                 kv_events: KVEventSink | None = None) -> None:
        self.config = config
        self.kv_events = kv_events         # the engine's prefix-cache changes go here (kv/events.py)
        # Requests waiting for the engine (queued, or added but not applied yet) beyond this
        # are refused with QueueFullError, so a flood cannot grow memory without bound.
        self.max_waiting_requests = max_waiting_requests if max_waiting_requests and max_waiting_requests > 0 \
            else None
        self.stat_loggers: list[StatLogger] = list(stat_loggers or [])
        self.stat_totals = StatTotals()    # engine thread: the dashboard's running totals
        self.stat_loggers.append(self.stat_totals)
        self._log = LoggingStatLogger(log_interval) if log_interval else None
        if self._log:
            self.stat_loggers.append(self._log)
        self.state = "created"             # created | starting | ready | failed | stopped | dead
        self.startup_error: BaseException | None = None
        self.fatal_error: BaseException | None = None
        # Set on the engine thread before `ready`, read-only afterwards.
        self.tokenizer: Any = None         # the front end's tokenizer (engine/tokenizer.py), not the engine's
        self.max_model_len = 0
        self.request_limits: RequestLimits | None = None
        self._prompts: TokenizerLane | None = None   # text prompts of calls the queue refuses, tokenized
        self._max_token_chars: int | None = None      # (on its thread, measured at first use)
        self.vocab_size = 0
        self.model_path = ""
        self.model_args: Any = None        # the base model's shapes (the server checks LoRA adapters against them)
        self.num_blocks = 0
        self.default_sampling: dict = {}   # the model's sampling defaults (LLMEngine.default_sampling)
        self.scheduler_stats = SchedulerStats()
        # Engine-thread state.
        self.engine: LLMEngine | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._holds_team = True            # this thread may hold OpenMP workers (it loaded or stepped)
        self._progress: dict[str, _Progress] = {}
        self._thread: threading.Thread | None = None
        # Event-loop state.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started: asyncio.Future | None = None
        self._dead: asyncio.Future | None = None
        self._streams: dict[str, RequestStream] = {}
        # For the queue limit: requests sent to the engine thread (event loop), and what the engine
        # last reported: (requests waiting, requests it had taken off the command queue by then).
        self._num_sent = 0
        self._num_taken = 0                # engine thread
        self._queue_view = (0, 0)

    # ---- lifecycle (event loop) --------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread (it loads the model); call from the event loop."""
        self._loop = asyncio.get_running_loop()
        self._started = self._loop.create_future()
        self._dead = self._loop.create_future()
        self.state = "starting"
        self._thread = threading.Thread(target=self._run, name="pagedserve-engine", daemon=True)
        self._thread.start()

    async def wait_started(self) -> None:
        """Wait until the model is loaded; raises the startup error if it failed."""
        assert self._started is not None, "start() first"
        await asyncio.shield(self._started)

    async def wait_dead(self) -> BaseException:
        """Return (the fault) once the engine has died; never returns while it is healthy."""
        assert self._dead is not None, "start() first"
        return await asyncio.shield(self._dead)

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    async def shutdown(self, timeout: float = 30.0) -> None:
        """Abort every request (their streams get the abort outputs) and stop the thread."""
        if self._prompts is not None:
            self._prompts.close()
        if self._thread is None or not self._thread.is_alive():
            return
        self._send(("stop",))
        await asyncio.to_thread(self._thread.join, timeout)

    # ---- requests (event loop) ---------------------------------------------------------------
    async def add_requests(self, items: list[tuple[str, PromptType, Params]],
                           arrival_time: float | None = None) -> RequestStream:
        """Add several requests as one unit: all are added, or none (the error is raised:
        ValueError for bad input)."""
        if not self.ready:
            raise EngineNotReadyError(f"the engine is {self.state}")
        ids = [rid for rid, _, _ in items]
        if len(set(ids)) != len(ids) or any(rid in self._streams for rid in ids):
            raise ValueError(f"request ids already in use: {ids}")
        # A first check here, on what the engine last reported plus the requests sent since;
        # the engine thread checks again exactly when it applies the add.
        waiting, taken = self._queue_view
        try:
            self._check_queue(len(items), waiting + self._num_sent - taken)
        except QueueFullError:
            # Bad input is a 400 whatever the queue's state (QueueFullError too if the lane that
            # tokenizes text prompts for this check is full).
            await self._check_without_engine(items)
            raise
        stream = RequestStream(self, ids)
        for rid in ids:
            self._streams[rid] = stream
        added = self._loop.create_future()
        self._num_sent += len(items)
        self._send(("add", items, arrival_time or time.monotonic(), added))
        try:
            await added
        except BaseException:
            stream.close()   # cancelled: the abort follows the add on the queue
            raise
        return stream

    async def _check_without_engine(self, items: list[tuple[str, PromptType, Params]]) -> None:
        """Every check of the requests that needs no engine state (InvalidRequestError), here,
        for a call the queue refuses anyway: a text prompt is tokenized on this engine's
        tokenizer thread (after the bound on its characters), never on the event loop."""
        for _, prompt, params in items:
            check_runner(params, self.config.is_pooling)
            text, ids = split_prompt(prompt)
            if ids is None:
                ids = await self._prompts.run(self._encode_within_context, text)
            check_given(ids, params, self.request_limits)

    def _encode_within_context(self, tokenizer: Any, text: str) -> list[int]:
        """(The tokenizer thread.) The text's token ids, unless it has more characters than the
        context could hold: then it is refused untokenized (bounded work per request)."""
        if self._max_token_chars is None:
            self._max_token_chars = max_token_chars(tokenizer)
        max_chars = self.max_model_len * self._max_token_chars
        if len(text) > max_chars:
            raise InvalidRequestError(
                f"the prompt is {len(text)} characters long; this model's maximum context length is "
                f"{self.max_model_len} tokens and no token of its tokenizer stands for more than "
                f"{self._max_token_chars} characters, so at most {max_chars} characters fit", "prompt",
                "context_length_exceeded")
        return tokenizer.encode(text)

    def check_num_prompts(self, num_new: int) -> None:
        """ValueError if one call could never be queued whole."""
        check_num_prompts(num_new, self.max_waiting_requests)

    def _check_queue(self, num_new: int, num_waiting: int) -> None:
        cap = self.max_waiting_requests
        if cap is None:
            return
        self.check_num_prompts(num_new)
        if num_waiting + num_new > cap:
            raise QueueFullError(f"the server is overloaded: {num_waiting} requests are already waiting "
                                 f"and at most {cap} may wait (--max-waiting-requests); retry later")

    async def generate(self, prompt: PromptType, params: Params,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """One prompt's outputs as they come, shaped by params.output_kind (cumulative, delta or
        final only); leaving the loop early aborts it."""
        kind = getattr(params, "output_kind", RequestOutputKind.CUMULATIVE)
        stream = await self.add_requests([(request_id, prompt, params)])
        sent: dict[int, tuple[int, int]] = {}   # per completion: text and tokens already yielded
        try:
            async for out in stream:
                if kind == RequestOutputKind.FINAL_ONLY and not out.finished:
                    continue
                if kind == RequestOutputKind.DELTA:
                    out = copy.copy(out)
                    out.outputs = [delta_output(c, sent) for c in out.outputs]
                yield out
        finally:
            stream.close()

    def abort(self, request_ids: list[str]) -> None:
        self._send(("abort", list(request_ids)))

    async def kv_capture(self) -> EngineCapture:
        """A copy of the KV cache and the requests, taken on the engine thread between two steps
        (engine/kv_view.py renders it)."""
        if not self.ready:
            raise EngineNotReadyError(f"the engine is {self.state}")
        done = self._loop.create_future()
        self._send(("snapshot", done))
        return await done

    def abort_all(self) -> None:
        self._send(("abort_all",))

    def _send(self, command: tuple) -> None:
        self._commands.put(command)
        self._wake.set()

    def _unregister(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._streams.pop(rid, None)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream._put(out)
                if out.finished:
                    del self._streams[out.request_id]

    def _fail(self, request_ids: list[str], error: BaseException) -> None:
        for rid in request_ids:
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream._put(error)

    def _on_dead(self, error: EngineDeadError) -> None:
        """On the event loop, once the engine thread has died: fail every stream and every add
        still queued (add_requests refuses new ones, since the state is dead)."""
        self._fail(list(self._streams), error)
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if command[0] in ("add", "snapshot"):
                self._resolve(command[-1], error)
        if not self._dead.done():
            self._dead.set_result(error)

    @staticmethod
    def _resolve(future: asyncio.Future, error: BaseException | None, result: Any = None) -> None:
        if future.done():
            return
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)

    def _call_soon(self, fn: Callable, *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass   # the event loop is closed: nobody is listening any more

    # ---- the engine thread -------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.engine = LLMEngine(self.config, self.kv_events)
            self.engine.on_grammar_ready = self._wake.set   # a compile ended: look at the queue again
            path = self.engine.model_path
            self.tokenizer = front_end_tokenizer(self.engine.tokenizer_path, self.config.load_format == "dummy",
                                                 load_chat_template(self.config.chat_template))
            self.default_sampling = self.engine.default_sampling
            self.max_model_len = self.engine.max_model_len
            self.request_limits = self.engine.request_limits
            # Used only while the queue is full: no more of those wait for it than may wait for the engine.
            self._prompts = TokenizerLane("pagedserve-engine-prompts", self.tokenizer, copy_tokenizer=True,
                                          max_jobs=self.max_waiting_requests)
            self.vocab_size = self.engine.vocab_size
            self.model_path = path
            self.model_args = self.engine.model_args
            self.num_blocks = self.engine.kv_cache_stats()["num_blocks"]
        except BaseException as e:   # noqa: BLE001 - reported to whoever waits for the start
            logger.exception("the engine failed to start")
            self.startup_error = e
            self.state = "failed"
            self._call_soon(self._resolve, self._started, e)
            return
        self.state = "ready"
        self._call_soon(self._resolve, self._started, None)
        if self._log:
            self._log.restart_clock()
        self._publish(None)
        logger.info("engine ready: %s, max_model_len %d, %d KV blocks of %d tokens", self.model_path,
                    self.max_model_len, self.num_blocks, self.config.block_size)
        with _running_lock:
            _running.add(self)
            others = [e for e in _running if e is not self]
        for other in others:   # an idle engine that was alone holds its workers: let it look again
            other._wake.set()
        try:
            self._serve()
        except BaseException as e:   # noqa: BLE001 - the engine cannot go on: say so, never hang
            self._die(e)
            return
        finally:
            with _running_lock:
                _running.discard(self)
            self.engine.shutdown()   # the worker processes of tensor parallelism go with the engine
        self.state = "stopped"

    def _serve(self) -> None:
        running = True
        while running:
            self._wake.clear()
            running = self._apply_commands()
            if running and self.engine.has_unfinished_requests() and not self.engine.only_waiting_for_grammars():
                self._step()
                self._holds_team = True
            elif running:
                if self._holds_team and len(_running) > 1:
                    release_thread_team()
                    self._holds_team = False
                self._wake.wait(self._log.seconds_until_due() if self._log else None)
            if self._log:
                try:
                    self._log.maybe_log()
                except Exception:   # noqa: BLE001 - logging must never stop the engine
                    logger.exception("the stats log failed")

    def _die(self, error: BaseException) -> None:
        logger.critical("the engine thread failed and cannot go on; every request fails from now on",
                        exc_info=error)
        self.fatal_error = error
        self.state = "dead"   # before the callback: add_requests refuses from now on
        self._call_soon(self._on_dead, EngineDeadError(f"the engine failed and cannot go on: {error!r}"))

    def _apply_commands(self) -> bool:
        """Apply queued commands; False once told to stop."""
        applied = False
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            kind = command[0]
            if kind == "snapshot":   # reads only: no stats to publish
                self._snapshot(command[1])
                continue
            applied = True
            if kind == "add":
                self._add(*command[1:])
            elif kind == "abort":
                self._abort(command[1])
            elif kind == "abort_all":
                self._abort(list(self.engine.requests))
            elif kind == "stop":
                self._abort(list(self.engine.requests))
                self._publish(None)
                return False
        if applied:
            self._publish(None)
        return True

    def _add(self, items: list, arrival_time: float, done: asyncio.Future) -> None:
        added: list[Request] = []
        self._num_taken += len(items)
        try:
            # Every request is checked before the queue's room: bad input is refused as such (a
            # 400), whatever the queue's state, never "retry later" first.
            checked = [self.engine.check_request(rid, prompt, params, arrival_time) for rid, prompt, params in items]
            self._check_queue(len(items), self.engine.scheduler.queues.num_waiting)
            for req in checked:
                added.append(self.engine.queue_request(req))
        except Exception as e:   # noqa: BLE001 - handed back to the caller
            for req in added:    # all or nothing: leave no blocks behind
                self.engine.abort_request(req.request_id)
            self._call_soon(self._resolve, done, e)
            return
        for req in added:
            self._progress[req.request_id] = _Progress(len(req.prompt_token_ids))
        self._call_soon(self._resolve, done, None)

    def _snapshot(self, done: asyncio.Future) -> None:
        try:
            result, error = capture(self.engine, asdict(self.stat_totals)), None
        except Exception as e:   # noqa: BLE001 - handed back to the caller
            result, error = None, e
        self._call_soon(self._resolve, done, error, result)

    def _abort(self, request_ids: list[str]) -> None:
        outputs = []
        iteration = IterationStats()
        for rid in request_ids:
            out = self.engine.abort_request(rid)
            if out is not None:
                outputs.append(out)
                self._account(out, iteration)
        if outputs:
            self._call_soon(self._dispatch, outputs)
            self._publish(iteration)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:   # noqa: BLE001 - the engine's policy says what it means
            failure = self.engine.recover(e)
            if failure.fatal is not None:
                raise failure.fatal   # the loop dies: every stream fails with EngineDeadError
            if failure.reset:
                logger.exception("an engine step failed; failing the %d requests in flight and starting the KV "
                                 "cache afresh", len(failure.failed))
            self._fail_requests(failure.failed)   # the step checked the invariants after dropping them
            if failure.reset:
                self._publish(None)
                return
            outputs = failure.outputs
        iteration = IterationStats()
        handed = []
        for out in outputs:
            try:
                self._account(out, iteration)
            except Exception as e:   # noqa: BLE001 - fails this request only
                self._fail_requests({out.request_id: e})
                continue
            handed.append(out)
        if handed:
            self._call_soon(self._dispatch, handed)
        self._publish(iteration)

    def _fail_requests(self, failures: dict[str, BaseException]) -> None:
        """Drop the requests (if the engine still has them) and fail their streams."""
        for rid, error in failures.items():
            if isinstance(error, InvalidRequestError):   # the request's own fault (e.g. its grammar): a 400
                logger.info("request %s refused in the engine: %s", rid, error)
            else:
                logger.error("request %s failed in the engine: %r", rid, error, exc_info=error)
            if rid in self.engine.requests:
                self.engine.abort_request(rid)
            self._progress.pop(rid, None)
            self._call_soon(self._fail, [rid], error if isinstance(error, InvalidRequestError) else
                            EngineStepError(f"the engine failed while running this request: {error!r}"))

    def _account(self, out: RequestOutput, it: IterationStats) -> None:
        """Fold one output into the step's stats. Generated tokens are counted over all the
        request's sequences (a beam-search request's when it finishes)."""
        p = self._progress.get(out.request_id)
        if p is None:
            return
        m = out.metrics
        if m.first_token_time is not None and p.last_token_time is None:
            it.num_prompt_tokens += p.num_prompt_tokens
            it.time_to_first_tokens.append(m.first_token_time - m.arrival_time)
        elif m.last_token_time is not None and m.last_token_time != p.last_token_time:
            it.inter_token_latencies.append(m.last_token_time - p.last_token_time)
        p.last_token_time = m.last_token_time
        num_tokens = sum(len(c.token_ids) for c in out.outputs)
        if num_tokens > p.num_tokens:
            it.num_generation_tokens += num_tokens - p.num_tokens
            p.num_tokens = num_tokens
        if out.finished:
            del self._progress[out.request_id]
            reasons = [c.finish_reason for c in out.outputs]
            reason = "abort" if not reasons or "abort" in reasons else reasons[0] or "abort"
            finished_time = m.finished_time or time.monotonic()
            it.finished.append(FinishedRequestStats(
                finish_reason=reason, e2e_latency=finished_time - m.arrival_time,
                queue_time=None if m.first_scheduled_time is None else m.first_scheduled_time - m.arrival_time,
                num_prompt_tokens=p.num_prompt_tokens, num_generation_tokens=p.num_tokens,
                lora_name=out.lora_request.lora_name if out.lora_request is not None else None))

    def _publish(self, iteration: IterationStats | None) -> None:
        self._queue_view = (self.engine.scheduler.queues.num_waiting, self._num_taken)   # one object: read whole
        self.scheduler_stats = self.engine.scheduler_stats()
        for stat_logger in self.stat_loggers:
            try:
                stat_logger.record(self.scheduler_stats, iteration)
            except Exception:   # noqa: BLE001 - metrics must never stop the engine
                logger.exception("stat logger %r failed", stat_logger)
