"""The offline API: `LLM(...).generate(prompts, SamplingParams(...))`, shaped like vLLM's."""
from __future__ import annotations

import dataclasses
import inspect
import logging
import time
import typing
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from pagedserve.config import EngineConfig
from pagedserve.engine.chat import load_chat_template, render_chat  # noqa: F401 - the server imports render_chat here
from pagedserve.engine.llm_engine import LLMEngine, PromptType
from pagedserve.lora.request import LoRARequest
from pagedserve.outputs import BeamSearchOutput, EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from pagedserve.pooling_params import PoolingParams
from pagedserve.sampling_params import BeamSearchParams, SamplingParams

logger = logging.getLogger(__name__)

Conversation = list[dict[str, Any]]


@dataclass
class Metric:
    """One of `LLM.get_metrics()`: a Prometheus-style name (the server's, vLLM's names) and value."""
    name: str
    value: float


class LLM:
    """The offline API. Keyword arguments are EngineConfig's fields (listed below), as vLLM's
    `LLM(model, ...)` takes its engine arguments."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        _drop_serving_topology(kwargs)
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))

    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLM":
        llm = cls.__new__(cls)
        llm.engine = LLMEngine(config)
        return llm

    @property
    def llm_engine(self) -> LLMEngine:
        """vLLM's name for the engine."""
        return self.engine

    def shutdown(self) -> None:
        """Stop the worker processes of a tensor-parallel engine (they also stop when this
        process exits); nothing to do for a one-process engine."""
        self.engine.shutdown()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def kv_cache_stats(self) -> dict:
        return self.engine.kv_cache_stats()

    def get_metrics(self) -> list[Metric]:
        """The engine's gauges and counters now, named as the server's /metrics names them."""
        stats = self.engine.scheduler_stats()
        names = {"num_running": "num_requests_running", "num_waiting": "num_requests_waiting",
                 "num_swapped": "num_requests_swapped", "kv_cache_usage": "kv_cache_usage_perc"}
        return [Metric("pagedserve:" + names.get(f.name, f.name), float(getattr(stats, f.name)))
                for f in dataclasses.fields(stats) if not isinstance(getattr(stats, f.name), (tuple, dict))]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix block. Only between requests (as vLLM): False while
        requests are unfinished, and nothing changes."""
        if self.engine.has_unfinished_requests():
            return False
        self.engine.reset()
        return True

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's defaults (generation_config.json; see
        EngineConfig.generation_config): what generate() uses when given none."""
        return SamplingParams(**self.engine.default_sampling)

    def kv_snapshot(self) -> dict:
        """Every KV block (state, reference count, owners, prefix-cache hash and text), the
        requests in flight with their block tables, and the counters: what the server's
        /v1/kv/snapshot returns (see engine/kv_view.py)."""
        return self.engine.kv_snapshot()

    def generate(self, prompts: PromptType | list[PromptType],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request: LoRARequest | list[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """lora_request: one LoRA adapter for every prompt, or one per prompt (None: the base
        model); the engine needs enable_lora=True."""
        prompts = self._as_list(prompts)
        params = sampling_params or self.get_default_sampling_params()
        if isinstance(params, list):
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        else:
            params = [params] * len(prompts)
        if isinstance(lora_request, list):
            if len(lora_request) != len(prompts):
                raise ValueError(f"got {len(lora_request)} lora requests for {len(prompts)} prompts")
        else:
            lora_request = [lora_request] * len(prompts)
        finals = self._run(list(zip(prompts, params, lora_request)), use_tqdm)
        return finals

    def chat(self, messages: Conversation | list[Conversation],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None,
             chat_template_kwargs: dict[str, Any] | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             lora_request: LoRARequest | list[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Generate replies to conversations rendered with the chat template: `chat_template`
        (a template or a file holding one; default: the engine's), `chat_template_kwargs`
        (more variables for it), `continue_final_message` (go on with the last message, an
        assistant's, instead of starting a new one), `tools` (function definitions for
        templates that show them; to make the model call one, constrain the output to its
        parameters with structured_outputs)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        template = load_chat_template(chat_template)
        prompts = [{"prompt_token_ids": render_chat(tok, conv, add_generation_prompt, template, continue_final_message,
                                                    chat_template_kwargs, tools)} for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def embed(self, prompts: PromptType | list[PromptType],
              pooling_params: PoolingParams | list[PoolingParams] | None = None,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """Embeddings of the prompts (an engine built with runner='pooling'): each output's
        `outputs.embedding`, as vLLM's LLM.embed returns them."""
        prompts = self._as_list(prompts)
        params = pooling_params or PoolingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} pooling params for {len(prompts)} prompts")
        finals = self._run(list(zip(prompts, params)), use_tqdm)
        return [EmbeddingRequestOutput(o.request_id, EmbeddingOutput(o.embedding), o.prompt_token_ids, o.finished)
                for o in finals]

    def beam_search(self, prompts: PromptType | list[PromptType], params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        prompts = self._as_list(prompts)
        requests = []
        self._run([(p, params) for p in prompts], use_tqdm, requests)
        return [self.engine.beam_search_output(r) for r in requests]

    # ---- internals -----------------------------------------------------------------------
    @staticmethod
    def _as_list(prompts) -> list:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
            return [prompts]   # one prompt given as token ids
        return list(prompts)

    def _run(self, items: list, use_tqdm: bool, requests: list | None = None) -> list[RequestOutput]:
        engine = self.engine
        ids = []
        try:
            for prompt, params, *lora in items:
                req = engine.add_request(None, prompt, params, lora_request=lora[0] if lora else None)
                ids.append(req.request_id)
                if requests is not None:
                    requests.append(req)
        except Exception:
            for rid in ids:   # refuse the whole batch, leaving nothing allocated
                engine.abort_request(rid)
            raise
        finals: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        start, n_out = time.perf_counter(), 0
        try:
            while engine.has_unfinished_requests():
                if engine.only_waiting_for_grammars():
                    engine.wait_for_grammars()
                    continue
                for out in engine.step():
                    if out.finished:
                        finals[out.request_id] = out
                        n_out += sum(len(c.token_ids) for c in out.outputs)
                        bar.update(1)
                        bar.set_postfix_str(f"output {n_out / (time.perf_counter() - start):.1f} tok/s")
        except BaseException as e:
            # What the failure means is the engine's policy (LLMEngine.recover: the failed requests
            # are dropped, or after a step that failed half way the KV bookkeeping starts afresh).
            # Offline, one failure fails the whole call: the other requests here go with it.
            engine.recover(e)
            for rid in ids:
                engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return [finals[rid] for rid in ids]


# The server's data-parallel settings (server/config.py's ServerConfig), which vLLM's LLM also
# takes: accepted here, and one engine runs (the offline API has no replicas).
SERVING_TOPOLOGY = ("data_parallel_size", "routing_policy", "ray_address")


def _drop_serving_topology(kwargs: dict[str, Any]) -> None:
    for name in SERVING_TOPOLOGY:
        value = kwargs.pop(name, None)
        if name == "data_parallel_size" and value not in (None, 1):
            logger.warning("LLM runs one engine: data_parallel_size=%s is the server's setting "
                           "(pagedserve serve --data-parallel-size); ignored here", value)


def _document_parameters(cls: type) -> None:
    """Give LLM.__init__ EngineConfig's fields as its signature and docstring, so help(LLM),
    inspect.signature and editors that read them list them (one list: the dataclass)."""
    hints = typing.get_type_hints(EngineConfig)
    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    params, doc = [self_param], []
    for f in dataclasses.fields(EngineConfig):
        if not f.init:
            continue
        default = f.default if f.default is not dataclasses.MISSING else None
        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD if f.name == "model" else inspect.Parameter.KEYWORD_ONLY
        params.append(inspect.Parameter(f.name, kind, default=default, annotation=hints[f.name]))
        doc.append(f"    {f.name}: {f.metadata.get('help', '')}")
    cls.__init__.__signature__ = inspect.Signature(params, return_annotation=None)
    cls.__init__.__doc__ = "Parameters (EngineConfig's fields):\n" + "\n".join(doc)


_document_parameters(LLM)
