"""LLMEngine: the synchronous step loop.

add_request() tokenizes and validates; step() drives one iteration: the scheduler
plans it, the worker runs it (on plain data, `SchedulerOutput.batch`), the scheduler
applies the result (`update_from_output`: tokens, stops, beams, freeing), and the
engine returns the outputs of every request that made progress.
"""
from __future__ import annotations

import concurrent.futures
import functools
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pagedserve.batch import StepBatch, TierMoves
from pagedserve.config import EngineConfig
from pagedserve.engine.chat import load_chat_template
from pagedserve.engine.detokenizer import OutputText
from pagedserve.engine.kv_view import KVView, capture
from pagedserve.engine.request_checks import (RequestLimits, check_max_tokens, check_params, check_prompt_ids,
                                             check_runner, split_prompt)
from pagedserve.errors import InvalidRequestError
from pagedserve.executor import WorkerFailedError, make_executor
from pagedserve.invariants import check_paging_invariants
from pagedserve.kv.events import KVEventSink
from pagedserve.kv.memory_usage import MemoryUsage
from pagedserve.kv.tier import TierIndex
from pagedserve.lora.adapter import LoRAReadError
from pagedserve.lora.registry import LoRARegistry
from pagedserve.lora.request import LoRARequest
from pagedserve.engine.stats import SchedulerStats
from pagedserve.kernels.threads import configure_threads
from pagedserve.models.loader import (GENERATION_DEFAULTS, default_model_path, generation_defaults, is_gguf,
                                     load_tokenizer)
from pagedserve.models.architectures import hf_architecture_names
from pagedserve.models.presets import PRESETS, is_preset
from pagedserve.models.resolve import ModelNotFoundError, resolve_model
from pagedserve.outputs import (BeamSearchOutput, BeamSearchSequence, CompletionOutput,
                                RequestMetrics, RequestOutput)
from pagedserve.request import Request, Sequence
from pagedserve.sampling.beam_search import beam_score
from pagedserve.pooling_params import PoolingParams
from pagedserve.sampling_params import BeamSearchParams, SamplingParams
from pagedserve.scheduler import Scheduler, SchedulerOutput
from pagedserve.structured.manager import GrammarCompiler
from pagedserve.utils import cdiv

logger = logging.getLogger(__name__)

PromptType = str | list[int] | dict

# Steps failing as a whole this many times in a row (no step succeeding between) mean a fault
# that no request causes: the engine is declared dead rather than failing every request forever.
MAX_STEP_FAILURES = 3


class EngineStalledError(RuntimeError):
    """The engine made no progress for `EngineConfig.watchdog_steps` steps while requests
    waited. Raised by `step()`; `recover` treats it as a step failed as a whole: those requests
    (`request_ids`, every one in flight) fail (LLM raises it, AsyncLLM hands it to their streams)."""

    def __init__(self, message: str, request_ids: list[str]) -> None:
        super().__init__(message)
        self.request_ids = request_ids


class RequestsFailed(Exception):
    """Handling some requests' part of a step raised: those requests were dropped (their
    blocks freed) and the step went on for the others, whose outputs this carries."""

    def __init__(self, failures: dict[str, Exception], outputs: list[RequestOutput]) -> None:
        super().__init__("; ".join(f"request {rid}: {e!r}" for rid, e in failures.items()))
        self.failures = failures
        self.outputs = outputs


@dataclass
class StepFailure:
    """What a step that raised means (LLMEngine.recover decides; LLM and AsyncLLM act on it)."""
    failed: dict[str, BaseException]                               # requests that fail, and why
    outputs: list[RequestOutput] = field(default_factory=list)     # the other requests' progress
    reset: bool = False                                            # the step failed as a whole
    fatal: BaseException | None = None                             # set: the engine cannot go on


def kv_storage_stats(config: EngineConfig, args, dtype: torch.dtype) -> dict:
    """What the KV cache stores: its dtype (auto: the model's) and bytes per token (all layers,
    K and V, an 8-bit cache's scales included; under tensor parallelism, one rank's heads)."""
    from pagedserve.attention.kv_format import kv_format
    fmt = kv_format(config.kv_cache_dtype)
    kv_heads = cdiv(args.num_kv_heads, config.tensor_parallel_size)   # a replicated head where fewer than ranks
    return dict(kv_cache_dtype=fmt.name if fmt.quantized else str(dtype).removeprefix("torch."),
                kv_bytes_per_token=fmt.bytes_per_token(args.num_layers, kv_heads, args.head_dim, dtype))


def override_generation_defaults(override: dict) -> dict:
    """--override-generation-config's keys (generation_config.json's names, or SamplingParams')
    as SamplingParams keywords; a key that is neither is refused."""
    known = set(GENERATION_DEFAULTS) | set(GENERATION_DEFAULTS.values())
    unknown = sorted(set(override) - known)
    if unknown:
        raise ValueError(f"override_generation_config: unsupported keys {unknown}; supported: {', '.join(sorted(known))}")
    return {GENERATION_DEFAULTS.get(k, k): v for k, v in override.items()}


class LLMEngine:
    def __init__(self, config: EngineConfig, kv_events: KVEventSink | None = None) -> None:
        self.config = config
        self.kv_events = kv_events      # told of prefix-cache changes (kv/events.py), e.g. for a router
        torch.manual_seed(config.seed)
        if config.trust_remote_code:
            logger.warning("trust_remote_code is accepted for vLLM compatibility and not needed: pagedserve runs "
                           "its own model code and never executes code from a checkpoint")
        configure_threads(config.num_threads)
        if config.model is None:
            path = default_model_path()
        elif config.load_format == "dummy" and is_preset(config.model):
            path = config.model          # a config by name (models/presets.py), no files
        else:
            path = self._resolve_model(config)
        self.model_path = path
        self.tokenizer_path = resolve_model(config.tokenizer, config.revision) if config.tokenizer else path
        self.tokenizer = load_tokenizer(self.tokenizer_path, stand_in=config.load_format == "dummy")
        if config.chat_template is not None:
            self.tokenizer.chat_template = load_chat_template(config.chat_template)
        self.default_sampling = generation_defaults(path, config.generation_config)
        if config.override_generation_config:   # vLLM's --override-generation-config: its keys win
            self.default_sampling.update(override_generation_defaults(config.override_generation_config))
        if self.default_sampling:
            logger.info("sampling defaults from the model's generation config (requests may override them; "
                        "generation_config='vllm' ignores them): %s", self.default_sampling)
        self.eos_token_ids = self._eos_token_ids(path)
        self.eos_token_id = self.tokenizer.eos_token_id
        # The worker owns the device: it loads the model there and sizes the KV cache. The
        # executor runs it in this process, or one shard per rank under tensor parallelism.
        self.executor = make_executor(config, path, self.eos_token_ids)
        worker = self.executor.worker
        self.runner, self.device = worker.runner, worker.device
        self.model_args, self.dtype = worker.model_args, worker.dtype
        self.max_model_len = worker.max_model_len
        self.vocab_size = worker.model_args.vocab_size
        self.num_blocks, self.num_host_blocks = worker.num_blocks, worker.num_host_blocks
        self.kv_windows = worker.kv_windows     # the KV groups' sliding windows (kv/groups.py)
        self.batch_dependent_steps = worker.batch_dependent_steps   # (Scheduler's: which steps mark blocks)
        self.kv_storage = kv_storage_stats(config, self.model_args, self.dtype)     # in kv_cache_stats()
        # The keys of the prefix cache's disk tier (kv/tier.py): its files outlive a reset, so does this.
        self.tier_index = TierIndex(worker.tier_capacity, worker.tier_keys, kv_events) if config.kv_offload else None
        self.scheduler = self._new_scheduler()
        # Sizes only (a value): AsyncLLM's event loop checks requests with them too. A reset's new
        # scheduler has a cache of the same sizes, so the same fit.
        self.request_limits = RequestLimits(self.max_model_len, self.vocab_size, config.max_logprobs,
                                            config.max_num_seqs, self.scheduler.kv.fit)
        self.loras = self._lora_registry(config)   # None unless enable_lora
        self.requests: dict[str, Request] = {}
        self.check_invariants = config.check_invariants or os.environ.get("PAGEDSERVE_CHECK_INVARIANTS") == "1"
        self.text = OutputText(self.tokenizer)   # the output side: token text and stop strings
        self._request_counter = 0
        self._steps_without_progress = 0
        self._step_failures = 0            # steps failed as a whole in a row (recover)
        self._grammars: GrammarCompiler | None = None   # built on the first structured request, or by the warm-up
        self._grammars_lock = threading.Lock()           # the engine thread's first use, the warm-up, shutdown
        self._shut_down = False
        self.on_grammar_ready: Callable[[], None] = lambda: None   # AsyncLLM wakes its thread
        self.num_steps = 0                 # step() calls so far (the dashboard's clock)
        self.step_observers: list[Callable[[], None]] = []   # called after each step (engine/kv_map.py)
        if config.structured_outputs_warmup and not config.is_pooling:
            threading.Thread(target=self._warm_grammars, name="pagedserve-grammar-warmup", daemon=True).start()

    @property
    def grammars(self) -> GrammarCompiler:
        """Compiles structured-output grammars off this thread (structured/manager.py)."""
        with self._grammars_lock:
            if self._grammars is None:
                if self._shut_down:
                    raise RuntimeError("the engine is shut down")
                self._grammars = self._new_grammars()
            return self._grammars

    def _new_grammars(self) -> GrammarCompiler:
        c = self.config
        grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids,
                                   max_cache_bytes=c.structured_outputs_cache_bytes,
                                   compile_timeout=c.structured_outputs_compile_timeout,
                                   max_grammar_bytes=c.structured_outputs_max_grammar_bytes)
        grammars.on_ready = lambda: self.on_grammar_ready()
        return grammars

    def _warm_grammars(self) -> None:
        """(A daemon thread at start.) Import xgrammar, read the vocabulary and start a compile
        process now, so the first structured request does not wait for them (seconds under load)."""
        try:
            self.grammars.warm()
        except Exception as e:   # noqa: BLE001 - the first structured request builds it and reports
            logger.info("structured outputs: the warm-up did not run (%s); the first request builds it", e)

    # ---- setup helpers -------------------------------------------------------------------
    @staticmethod
    def _resolve_model(config: EngineConfig) -> str:
        try:
            return resolve_model(config.model, config.revision)
        except ModelNotFoundError as e:
            if config.load_format != "dummy":
                raise
            raise ModelNotFoundError(f"{e}; with load_format='dummy' the model may also be a preset: "
                                     f"{', '.join(PRESETS)}") from None

    def _lora_registry(self, config: EngineConfig) -> LoRARegistry | None:
        if not config.enable_lora:
            return None
        if self.model_args.architecture not in hf_architecture_names():
            raise ValueError(f"enable_lora: LoRA adapters are served over Llama-family models "
                             f"({', '.join(hf_architecture_names())}), not {self.model_args.architecture}")
        return LoRARegistry(self.model_args, config.max_lora_rank)

    def lora_request_of(self, prompt: PromptType, lora_request: LoRARequest | None) -> LoRARequest | None:
        """The request's adapter (the argument, or a prompt dict's `lora_request`), checked and
        resolved; InvalidRequestError if LoRA is off or the adapter cannot be served."""
        if lora_request is None and isinstance(prompt, dict):
            lora_request = prompt.get("lora_request")
        if lora_request is None:
            return None
        if self.loras is None:
            raise InvalidRequestError("this engine serves no LoRA adapters: start it with enable_lora=True "
                                      "(--enable-lora)", "lora_request")
        return self.loras.check(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter (requests already queued with it finish with it)."""
        if self.loras is None or not self.loras.remove(lora_int_id):
            return False
        self.scheduler.loras.forget(lora_int_id)
        return True

    def _new_scheduler(self) -> Scheduler:
        return Scheduler(self.config, self.num_blocks, self.max_model_len, self.num_host_blocks,
                         self.eos_token_ids, self.kv_events, self.tier_index, self.kv_windows,
                         self.batch_dependent_steps)

    def _eos_token_ids(self, path: str) -> set[int]:
        if self.config.load_format == "dummy":
            return set()    # random weights: EOS would end sequences at random, so it never does
        ids = {self.tokenizer.eos_token_id} - {None}
        if not is_gguf(path):
            gen = Path(path) / "generation_config.json"
            if gen.exists():
                eos = json.loads(gen.read_text()).get("eos_token_id")
                ids |= set(eos if isinstance(eos, list) else [eos]) - {None}
        return ids

    # ---- requests ------------------------------------------------------------------------
    def next_request_id(self) -> str:
        self._request_counter += 1
        return str(self._request_counter)

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        text, ids = split_prompt(prompt)
        return text, ids if ids is not None else self.tokenizer.encode(text)

    @staticmethod
    def prompt_cache_salt(prompt: PromptType) -> str | None:
        """A prompt dict's `cache_salt`: its blocks are shared only with requests of the same salt."""
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise InvalidRequestError(f"cache_salt must be a non-empty string; got {salt!r}", "cache_salt")
        return salt

    def add_request(self, request_id: str | None, prompt: PromptType,
                    params: SamplingParams | BeamSearchParams | PoolingParams,
                    arrival_time: float | None = None, lora_request: LoRARequest | None = None) -> Request:
        """Queue a request. Everything about it is validated here, once, before anything is
        allocated: InvalidRequestError (a ValueError) names the parameter at fault."""
        return self.queue_request(self.check_request(request_id, prompt, params, arrival_time, lora_request))

    def check_request(self, request_id: str | None, prompt: PromptType,
                      params: SamplingParams | BeamSearchParams | PoolingParams,
                      arrival_time: float | None = None, lora_request: LoRARequest | None = None) -> Request:
        """Validate a request and build it without queueing it: no blocks, no grammar compile.
        AsyncLLM checks a whole add this way before its queue-room check, so bad input is
        refused as such whatever the queue's state."""
        request_id = request_id if request_id is not None else self.next_request_id()
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        check_runner(params, self.config.is_pooling)
        text, ids = self.tokenize_prompt(prompt)
        if isinstance(params, (SamplingParams, PoolingParams)) and params.truncate_prompt_tokens:
            ids = ids[-params.truncate_prompt_tokens:]
        salt = self.prompt_cache_salt(prompt)
        lora = self.lora_request_of(prompt, lora_request)
        if isinstance(params, PoolingParams):
            self.validate_prompt(ids)
            self.validate_pooling(params)
            max_tokens = 0     # prefill only
        else:
            max_tokens = self.validate_request(ids, params)
        req = Request.create(request_id, text, ids, params, max_tokens, self.scheduler.new_seq_id(),
                             arrival_time=arrival_time, cache_salt=salt,
                             pooling=self.config.pooling_type if isinstance(params, PoolingParams) else None,
                             lora=lora)
        self.scheduler.check_request(req)   # InvalidRequestError if it could never run
        return req

    def queue_request(self, req: Request) -> Request:
        """Queue a request check_request built: its grammar starts compiling (off this thread)."""
        params = req.params
        if isinstance(params, SamplingParams) and params.structured_outputs is not None:
            req.structured = self.grammars.new_state(params.structured_outputs)
        self.text.start(req)
        self.scheduler.queue_request(req)   # check_request checked its capacity (once)
        self.requests[req.request_id] = req
        return req

    @property
    def hidden_size(self) -> int:
        return self.model_args.hidden_size

    def validate_pooling(self, params: PoolingParams) -> None:
        """dimensions: only a Matryoshka model (config.json matryoshka_dimensions or is_matryoshka)
        keeps meaning when cut; any other accepts only its own hidden size."""
        d = params.dimensions
        if d is None or d == self.hidden_size:
            return
        allowed = self.matryoshka_dimensions
        if allowed is None:
            raise InvalidRequestError(f"this model does not support matryoshka representation: dimensions must be "
                                      f"its hidden size ({self.hidden_size}) or left out", "dimensions")
        if d > self.hidden_size or (allowed and d not in allowed):
            what = ", ".join(map(str, allowed)) if allowed else f"1 .. {self.hidden_size}"
            raise InvalidRequestError(f"dimensions {d} is not one this model supports ({what})", "dimensions")

    @functools.cached_property
    def matryoshka_dimensions(self) -> list[int] | None:
        """[] for any size up to the hidden size, a list of sizes, or None (not a Matryoshka model)."""
        cfg = Path(self.model_path) / "config.json"
        if is_gguf(self.model_path) or not cfg.is_file():
            return None
        data = json.loads(cfg.read_text())
        if data.get("matryoshka_dimensions"):
            return list(data["matryoshka_dimensions"])
        return [] if data.get("is_matryoshka") else None

    def validate_request(self, ids: list[int], params: SamplingParams | BeamSearchParams) -> int:
        """Check a request against this engine: its prompt, and token ids in its parameters (the
        parameters checked themselves when built; Scheduler.check_request adds what depends on
        its capacity). Returns its max_tokens (request_checks.check_max_tokens)."""
        self.validate_prompt(ids)
        self.validate_params(params)
        return check_max_tokens(ids, params, self.request_limits)

    def validate_prompt(self, ids: list[int]) -> None:
        check_prompt_ids(ids, self.request_limits)

    def validate_params(self, params: SamplingParams | BeamSearchParams) -> None:
        """request_checks.check_params, after bad_words become token ids (this engine's tokenizer)."""
        if isinstance(params, SamplingParams) and params.bad_words and not params.bad_words_token_ids:
            params.bad_words_token_ids = self.bad_words_token_ids(params.bad_words)
        check_params(params, self.request_limits)

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word's token ids as it would appear at the start of a text and after a space
        (different tokens in most vocabularies), as vLLM bans them."""
        out: list[list[int]] = []
        for word in words:
            for text in (word.strip(), " " + word.strip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in out:
                    out.append(ids)
        return out

    def abort_request(self, request_id: str) -> RequestOutput | None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self.scheduler.abort_request(req)
        if self.check_invariants:
            self.check_paging_invariants()
        return self._output(req, finished=True)

    def reset(self) -> list[str]:
        """Drop every request and start the scheduler and the KV bookkeeping afresh; returns
        the ids dropped. For after a step that failed half way: the blocks it was writing may
        be registered in the prefix cache with partial contents, so no block is kept."""
        dropped = list(self.requests)
        stats = self.scheduler.stats
        self.scheduler = self._new_scheduler()
        self.scheduler.stats = stats
        self.executor.forget_sequences()   # seq ids start afresh
        self.requests.clear()
        return dropped

    def shutdown(self) -> None:
        """Stop the executor's worker processes (tensor parallelism) and the grammar compiles."""
        with self._grammars_lock:   # (a warm-up after this builds nothing)
            self._shut_down = True
            grammars = self._grammars
        if grammars is not None:
            grammars.close()
        tier = self.scheduler.tier
        if tier is not None and self.config.kv_offload_path:   # the pool's cached blocks go to the disk tier, for the next start
            tier.save_cached()
            saves, _, deletes = tier.take()
            self.executor.move_blocks(StepBatch(tier=TierMoves(saves, deletes)))
        self.executor.shutdown()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def only_waiting_for_grammars(self) -> bool:
        """Every unfinished request waits for its grammar to compile: a step would do nothing
        (wait_for_grammars, or AsyncLLM sleeps until on_grammar_ready)."""
        return self.scheduler.queues.only_waiting_for_grammars()

    def wait_for_grammars(self, timeout: float | None = None) -> None:
        """Block until one of the grammars being compiled is ready (or timeout seconds)."""
        pending = [r.structured.compiled for r in self.scheduler.queues.waiting_for_grammars()]
        if pending:
            concurrent.futures.wait(pending, timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    def _drop_failed_grammars(self) -> dict[str, Exception]:
        """Requests whose grammar failed to compile end with that error, before they run."""
        failed = {}
        for req in self.scheduler.queues.failed_grammars():
            failed[req.request_id] = req.structured.error
            self.scheduler.abort_request(req)
            self.requests.pop(req.request_id, None)
        return failed

    # ---- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        self.num_steps += 1
        try:
            outputs = self._step()
            self._step_failures = 0
            return outputs
        finally:
            for observe in self.step_observers:
                try:
                    observe()
                except Exception:   # noqa: BLE001 - watching a step must never fail it
                    logger.exception("step observer %r failed", observe)

    def _step(self) -> list[RequestOutput]:
        grammar_failures = self._drop_failed_grammars()
        sched = self.scheduler.schedule()
        if self.check_invariants:
            self.check_paging_invariants(sched)
        if sched.empty:
            self.executor.move_blocks(sched.batch)   # swaps move even in a step that runs nothing
            if self.tier_index is not None:          # the disk tier's reads: waited for when nothing else runs
                wait = sched.batch.tier.wait if sched.batch.tier is not None else []
                self.scheduler.apply_tier_report(self.executor.tier_report(wait))
            if grammar_failures:
                raise RequestsFailed(grammar_failures, [])
            self._watchdog()
            return []
        self._steps_without_progress = 0
        result = self.executor.execute(sched.batch)
        update = self.scheduler.update_from_output(sched, result)
        for e in update.failed.values():
            if isinstance(e, LoRAReadError) and self.loras is not None:
                self.loras.forget_failed(e.lora_int_id)     # checked again at its next request

        # The output side: the step's tokens become text, where the stop strings are checked (a
        # hit ends its sequence through the scheduler); then the request's output. Either may
        # raise too: that fails this request alone.
        failed = {**grammar_failures, **update.failed}
        outputs: list[RequestOutput] = []
        for req in update.progressed:
            try:
                for seq, stop in self.text.update(req):
                    if self.scheduler.stop_seq(req, seq, stop):
                        update.finished.add(req.request_id)
                outputs.append(self._output(req, finished=req.request_id in update.finished))
            except Exception as e:   # noqa: BLE001 - the caller fails this request only
                failed[req.request_id] = e
                self.scheduler.abort_request(req)
        for rid in update.finished | failed.keys():
            self.requests.pop(rid, None)
        if self.check_invariants:
            self.check_paging_invariants()
        if failed:
            raise RequestsFailed(failed, outputs)
        return outputs

    def recover(self, error: BaseException) -> StepFailure:
        """The step-failure policy, in one place: what `error`, raised by step(), means, with
        the engine's part of it done. Both drivers (LLM, AsyncLLM) call it and act on the answer.
        - RequestsFailed: those requests alone fail (already dropped); the step's other
          outputs stand and the step counts as a success.
        - Anything else failed the step as a whole: every request in flight fails and the KV
          bookkeeping starts afresh (reset: a half-written block must not stay in the prefix
          cache). A lost tensor-parallel rank (WorkerFailedError), or MAX_STEP_FAILURES such
          steps in a row, is fatal: the engine cannot go on."""
        if isinstance(error, RequestsFailed):
            self._step_failures = 0
            for rid in error.failures:
                if rid in self.requests:
                    self.abort_request(rid)
            return StepFailure(dict(error.failures), error.outputs)
        self._step_failures += 1
        failed = {rid: error for rid in self.reset()}
        fatal = None
        if isinstance(error, WorkerFailedError):
            fatal = error
        elif self._step_failures >= MAX_STEP_FAILURES:
            fatal = RuntimeError(f"{self._step_failures} engine steps in a row failed")
            fatal.__cause__ = error
        return StepFailure(failed, [], reset=True, fatal=fatal)

    def _watchdog(self) -> None:
        """Count steps that computed nothing while requests wait; after watchdog_steps in a
        row, log the scheduler's state and raise EngineStalledError instead of spinning. (Waiting
        for a grammar to compile is no stall.)"""
        if not self.requests or self.scheduler.queues.waiting_for_grammars():
            return
        self._steps_without_progress += 1
        limit = self.config.watchdog_steps
        if not limit or self._steps_without_progress < limit:
            return
        self._steps_without_progress = 0
        ids = list(self.requests)
        logger.error("watchdog: no progress in %d steps with %d requests unfinished; scheduler state: %s",
                     limit, len(ids), self.scheduler.describe())
        raise EngineStalledError(f"the engine made no progress in {limit} steps (a scheduler bug); failing "
                                 f"the {len(ids)} unfinished requests", ids)

    # ---- outputs -------------------------------------------------------------------------
    def _output(self, req: Request, finished: bool) -> RequestOutput:
        if req.pooling is not None:
            return self._pooling_output(req, finished)
        if req.is_beam_search:
            # Beam search has a result only at the end: its best hypotheses, best first.
            outputs = self._beam_completions(req) if finished else []
        else:
            seqs = sorted(req.seqs, key=lambda s: s.index)
            if finished and req.params.best_of > req.params.n:
                seqs = sorted(seqs, key=lambda s: -s.cumulative_logprob)[:req.params.n]
            outputs = [self._completion(s, i, req.params.needs_logprobs) for i, s in enumerate(seqs)]
        metrics = self._metrics(req, finished)
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, req.prompt_logprobs, outputs,
                             finished, req.num_cached_tokens, metrics, lora_request=req.lora)

    def _pooling_output(self, req: Request, finished: bool) -> RequestOutput:
        """A pooling request's output: no text or tokens; once finished, its embedding (MEAN:
        the mean of the rows; cut to `dimensions`, then normalised unless asked not to)."""
        seq = req.seqs[0]
        embedding = None
        if finished and seq.finish_reason == "stop" and req.pooled is not None:
            p: PoolingParams = req.params
            v = torch.from_numpy(req.pooled)
            if req.pooling == "MEAN":
                v = (v / len(req.prompt_token_ids)).float()   # the float64 sum of the rows (ModelRunner._pool)
            if p.dimensions is not None:
                v = v[:p.dimensions]
            if (p.normalize if p.normalize is not None else self.config.pooling_normalize):
                v = torch.nn.functional.normalize(v, dim=0)
            embedding = v.tolist()
        metrics = self._metrics(req, finished)
        out = CompletionOutput(0, "", [], None, None, finish_reason=seq.finish_reason)
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, None, [out], finished,
                             req.num_cached_tokens, metrics, embedding)

    @staticmethod
    def _metrics(req: Request, finished: bool) -> RequestMetrics:
        return RequestMetrics(req.arrival_time, req.first_scheduled_time, req.first_token_time,
                              req.last_token_time, time.monotonic() if finished else None)

    @staticmethod
    def _completion(seq: Sequence, index: int, with_cum_logprob: bool) -> CompletionOutput:
        return CompletionOutput(
            index=index,
            text=OutputText.visible_text(seq),
            token_ids=list(seq.output_token_ids),
            cumulative_logprob=seq.cumulative_logprob if with_cum_logprob else None,
            logprobs=seq.logprobs,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )

    def beam_search_output(self, req: Request) -> BeamSearchOutput:
        """A finished beam-search request's best hypotheses, best first (vLLM's LLM.beam_search)."""
        p: BeamSearchParams = req.params
        hyps = [s for s in req.seqs if s.finished]
        hyps.sort(key=lambda s: -beam_score(s.token_ids, s.cumulative_logprob, self.eos_token_ids,
                                            p.length_penalty))
        out = BeamSearchOutput()
        for s in hyps[:p.beam_width]:
            gen = s.output_token_ids
            if gen and gen[-1] in self.eos_token_ids and not p.ignore_eos:
                gen = gen[:-1]
            text = self.tokenizer.decode(gen, skip_special_tokens=True)
            out.sequences.append(BeamSearchSequence(list(s.token_ids), s.cumulative_logprob, text, s.finish_reason))
        return out

    def _beam_completions(self, req: Request) -> list[CompletionOutput]:
        n_prompt = len(req.prompt_token_ids)
        return [CompletionOutput(index=i, text=s.text, token_ids=s.tokens[n_prompt:], cumulative_logprob=s.cum_logprob,
                                 logprobs=None, finish_reason=s.finish_reason)
                for i, s in enumerate(self.beam_search_output(req).sequences)]

    # ---- introspection -------------------------------------------------------------------
    def kv_cache_stats(self) -> dict:
        stats = self.scheduler.kv.stats().as_dict()
        sched = self.scheduler.stats
        stats.update(num_preemptions=sched.num_preemptions, num_recomputed_tokens=sched.num_recomputed_tokens,
                     sharing_saving_avg=sched.sharing_saving_avg, **self.kv_storage)
        if self.config.speculative_config is not None:
            stats.update(sched.spec.as_dict())
        return stats

    def scheduler_stats(self) -> SchedulerStats:
        """The scheduler and KV cache now, as stat loggers and LLM.get_metrics see them."""
        kv = self.kv_cache_stats()
        queues = self.scheduler.queues
        return SchedulerStats(
            num_running=queues.num_running, num_waiting=queues.num_waiting, num_swapped=queues.num_swapped,
            kv_cache_usage=kv["usage"],
            prefix_cache_queries=kv["prefix_cache_queries"], prefix_cache_hits=kv["prefix_cache_hits"],
            num_preemptions=kv["num_preemptions"], num_swapped_out_blocks=kv["num_swapped_out_blocks"],
            num_swapped_in_blocks=kv["num_swapped_in_blocks"], num_recomputed_tokens=kv["num_recomputed_tokens"],
            spec_decode_num_drafts=self.scheduler.stats.spec.num_drafts,
            spec_decode_num_draft_tokens=self.scheduler.stats.spec.num_draft_tokens,
            spec_decode_num_accepted_tokens=self.scheduler.stats.spec.num_accepted_tokens,
            spec_decode_num_accepted_tokens_per_pos=tuple(self.scheduler.stats.spec.accepted_per_pos),
            external_prefix_cache_queries=kv.get("kv_offload_queries", 0),
            external_prefix_cache_hits=kv.get("kv_offload_hits", 0), kv_offload_blocks=kv.get("kv_offload_blocks", 0),
            kv_offload_bytes_written=kv.get("kv_offload_bytes_written", 0),
            kv_offload_bytes_read=kv.get("kv_offload_bytes_read", 0),
            kv_group_blocks=tuple((f"{g}:{name}", n) for g, (name, n) in
                                  enumerate(zip(kv.get("kv_groups", ()), kv.get("num_blocks_per_group", ())))),
            **self._lora_stats())

    def _lora_stats(self) -> dict:
        if self.loras is None:
            return {}
        running: dict[str, int] = {}
        waiting: dict[str, int] = {}
        for status, req in self.scheduler.queues.by_status():
            if req.lora is not None:
                side = waiting if status == "waiting" else running
                side[req.lora.lora_name] = side.get(req.lora.lora_name, 0) + 1
        return dict(running_lora_adapters=running, waiting_lora_adapters=waiting, max_lora=self.config.max_loras)

    def kv_snapshot(self) -> dict:
        """The KV cache block by block, the requests with their block tables, and the counters,
        as the dashboard's /v1/kv/snapshot returns them (engine/kv_view.py)."""
        return KVView(self.decode_tokens).full(capture(self))

    def decode_tokens(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)

    def memory_usage(self) -> MemoryUsage:
        """The KV cache's slots right now: token states, reserved, internal and external
        fragmentation, free (the paper's memory-waste breakdown, Fig. 2)."""
        return self.scheduler.memory_usage()

    def check_paging_invariants(self, sched: SchedulerOutput | None = None) -> None:
        """All of pagedserve/invariants.py; with `sched`, also what that step is about to write."""
        check_paging_invariants(self.scheduler, sched, self.requests)
