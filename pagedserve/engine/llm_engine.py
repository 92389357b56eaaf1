"""LLMEngine: the synchronous step loop.

add_request() tokenizes and validates; step() drives one iteration: the scheduler
plans it, the worker runs it (on plain data, `SchedulerOutput.batch`), the scheduler
applies the result (`update_from_output`: tokens, stops, beams, freeing), and the
engine returns the outputs of every request that made progress.
"""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from pagedserve.config import EngineConfig
from pagedserve.engine.detokenizer import IncrementalDetokenizer
from pagedserve.errors import InvalidRequestError
from pagedserve.executor import make_executor
from pagedserve.invariants import check_paging_invariants
from pagedserve.kv.memory_usage import MemoryUsage
from pagedserve.models.loader import default_model_path, is_gguf, load_tokenizer
from pagedserve.outputs import (BeamSearchOutput, BeamSearchSequence, CompletionOutput,
                                RequestMetrics, RequestOutput)
from pagedserve.request import Request, Sequence
from pagedserve.sampling.beam_search import beam_score
from pagedserve.sampling_params import BeamSearchParams, SamplingParams
from pagedserve.scheduler import Scheduler, SchedulerOutput
import torch

logger = logging.getLogger(__name__)

PromptType = str | list[int] | dict


class EngineStalledError(RuntimeError):
    """The engine made no progress for `EngineConfig.watchdog_steps` steps while requests
    waited. Raised by `step()`; the caller fails those requests (`request_ids`) by aborting
    them, as after any failed step (LLM raises it, AsyncLLM hands it to their streams)."""

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


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        torch.manual_seed(config.seed)
        path = config.model or default_model_path()
        self.model_path = path
        self.tokenizer = load_tokenizer(config.tokenizer or path)
        self.eos_token_ids = self._eos_token_ids(path)
        self.eos_token_id = self.tokenizer.eos_token_id
        # The worker owns the device: it loads the model there and sizes the KV cache. The
        # executor runs it in this process, or one shard per rank under tensor parallelism.
        self.executor = make_executor(config, path, self.eos_token_ids)
        worker = self.executor.worker
        self.runner, self.device = worker.runner, worker.device
        self.model_args, self.dtype = worker.model_args, worker.dtype
        try:
            self.max_model_len = self._resolve_max_model_len(config.max_model_len, worker.model_args)
        except BaseException:
            self.executor.shutdown()
            raise
        self.vocab_size = worker.model_args.vocab_size
        self.num_blocks, self.num_host_blocks = worker.num_blocks, worker.num_host_blocks
        self.scheduler = self._new_scheduler()
        self.requests: dict[str, Request] = {}
        self.check_invariants = config.check_invariants or os.environ.get("PAGEDSERVE_CHECK_INVARIANTS") == "1"
        self._backend_tokenizer = self.tokenizer.backend_tokenizer
        self._request_counter = 0
        self._steps_without_progress = 0

    # ---- setup helpers -------------------------------------------------------------------
    def _new_scheduler(self) -> Scheduler:
        return Scheduler(self.config, self.num_blocks, self.max_model_len, self.num_host_blocks,
                         self.eos_token_ids, self.tokenizer.convert_ids_to_tokens)

    @staticmethod
    def _resolve_max_model_len(requested: int | None, args) -> int:
        limit = args.max_position_embeddings
        if args.sliding_window:
            limit = min(limit, args.sliding_window)   # no sliding-window attention: stay inside it
        if requested is None:
            return limit
        if requested > limit:
            raise ValueError(f"max_model_len {requested} is longer than the model's context ({limit})")
        return requested

    def _eos_token_ids(self, path: str) -> set[int]:
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
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise InvalidRequestError(f"a prompt must be a string, a list of token ids or a dict; got "
                                  f"{type(prompt).__name__}", "prompt")

    @staticmethod
    def prompt_cache_salt(prompt: PromptType) -> str | None:
        """A prompt dict's `cache_salt`: its blocks are shared only with requests of the same salt."""
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise InvalidRequestError(f"cache_salt must be a non-empty string; got {salt!r}", "cache_salt")
        return salt

    def add_request(self, request_id: str | None, prompt: PromptType,
                    params: SamplingParams | BeamSearchParams, arrival_time: float | None = None) -> Request:
        """Queue a request. Everything about it is validated here, once, before anything is
        allocated: InvalidRequestError (a ValueError) names the parameter at fault."""
        request_id = request_id if request_id is not None else self.next_request_id()
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        text, ids = self.tokenize_prompt(prompt)
        salt = self.prompt_cache_salt(prompt)
        max_tokens = self.validate_request(ids, params)
        n_prompt = len(ids)
        req = Request(request_id, text, ids, params, max_tokens, cache_salt=salt)
        if arrival_time is not None:
            req.arrival_time = arrival_time
        seq = Sequence(self.scheduler.new_seq_id(), 0, list(ids), n_prompt)
        if isinstance(params, SamplingParams):
            seq.detokenizer = IncrementalDetokenizer(
                self._backend_tokenizer, ids, params.skip_special_tokens, params.stop_strings,
                params.include_stop_str_in_output)
            if params.logprobs is not None:
                seq.logprobs = []
            req.pending_fork = params.best_of > 1
            if params.prompt_logprobs is not None:
                req.prompt_logprobs = [None]
        req.seqs.append(seq)
        self.scheduler.add_request(req)   # raises InvalidRequestError if it could never run
        self.requests[request_id] = req
        return req

    def validate_request(self, ids: list[int], params: SamplingParams | BeamSearchParams) -> int:
        """Check a request against this engine: its prompt, and token ids in its parameters (the
        parameters checked themselves when built; Scheduler.add_request adds what depends on
        its capacity). Returns its max_tokens: the requested number (None: no limit) cut to what
        the context holds after the prompt. The one place max_tokens is resolved."""
        self.validate_prompt(ids)
        self.validate_params(params)
        room = self.max_model_len - len(ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        if isinstance(params, SamplingParams) and params.min_tokens > max_tokens:
            raise InvalidRequestError(f"min_tokens ({params.min_tokens}) must be <= max_tokens ({max_tokens})",
                                      "min_tokens")
        return max_tokens

    def validate_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise InvalidRequestError("the prompt is empty: give at least one token", "prompt")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt is {len(ids)} tokens long; this model's maximum context length is "
                f"{self.max_model_len} tokens, which must also hold at least one generated token", "prompt",
                "context_length_exceeded")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"token ids out of vocabulary (size {self.vocab_size}): {bad[:5]}", "prompt")

    def validate_params(self, params: SamplingParams | BeamSearchParams) -> None:
        """Token ids in the parameters index the logits: one outside the vocabulary would fail
        the whole step, so it is refused here."""
        if not isinstance(params, SamplingParams):
            return
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or ())):
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"{name} has token ids out of vocabulary (size {self.vocab_size}): {bad[:5]}", name)

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
        """Stop the executor's worker processes (tensor parallelism); nothing to do in one process."""
        self.executor.shutdown()

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- the step ------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        if self.check_invariants:
            self.check_paging_invariants(sched)
        if sched.empty:
            self.executor.move_blocks(sched.batch)   # swaps move even in a step that runs nothing
            self._watchdog()
            return []
        self._steps_without_progress = 0
        result = self.executor.execute(sched.batch)
        update = self.scheduler.update_from_output(sched, result)

        # Building one request's output may raise too: that fails this request alone.
        failed = dict(update.failed)
        outputs: list[RequestOutput] = []
        for req in update.progressed:
            try:
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

    def _watchdog(self) -> None:
        """Count steps that computed nothing while requests wait; after watchdog_steps in a
        row, log the scheduler's state and raise EngineStalledError instead of spinning."""
        if not self.requests:
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
        if req.is_beam_search:
            # Beam search has a result only at the end: its best hypotheses, best first.
            outputs = self._beam_completions(req) if finished else []
        else:
            seqs = sorted(req.seqs, key=lambda s: s.index)
            if finished and req.params.best_of > req.params.n:
                seqs = sorted(seqs, key=lambda s: -s.cumulative_logprob)[:req.params.n]
            outputs = [self._completion(s, i, req.params.needs_logprobs) for i, s in enumerate(seqs)]
        metrics = RequestMetrics(req.arrival_time, req.first_scheduled_time, req.first_token_time,
                                 req.last_token_time, time.monotonic() if finished else None)
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, req.prompt_logprobs, outputs,
                             finished, req.num_cached_tokens, metrics)

    @staticmethod
    def _completion(seq: Sequence, index: int, with_cum_logprob: bool) -> CompletionOutput:
        return CompletionOutput(
            index=index,
            text=seq.detokenizer.visible_text(seq.finished),
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
                     sharing_saving_avg=sched.sharing_saving_avg)
        return stats

    def memory_usage(self) -> MemoryUsage:
        """The KV cache's slots right now: token states, reserved, internal and external
        fragmentation, free (the paper's memory-waste breakdown, Fig. 2)."""
        return self.scheduler.memory_usage()

    def check_paging_invariants(self, sched: SchedulerOutput | None = None) -> None:
        """All of pagedserve/invariants.py; with `sched`, also what that step is about to write."""
        check_paging_invariants(self.scheduler, sched, self.requests)
