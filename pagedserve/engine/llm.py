"""The offline API: `LLM(...).generate(prompts, SamplingParams(...))`, shaped like vLLM's."""
from __future__ import annotations

import time
from typing import Any

from tqdm import tqdm

from pagedserve.config import EngineConfig
from pagedserve.engine.llm_engine import LLMEngine, PromptType, RequestsFailed
from pagedserve.outputs import BeamSearchOutput, RequestOutput
from pagedserve.sampling_params import BeamSearchParams, SamplingParams

Conversation = list[dict[str, Any]]


class LLM:
    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))

    def shutdown(self) -> None:
        """Stop the worker processes of a tensor-parallel engine (they also stop when this
        process exits); nothing to do for a one-process engine."""
        self.engine.shutdown()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def kv_cache_stats(self) -> dict:
        return self.engine.kv_cache_stats()

    def generate(self, prompts: PromptType | list[PromptType],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        prompts = self._as_list(prompts)
        params = sampling_params or SamplingParams()
        if isinstance(params, list):
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        else:
            params = [params] * len(prompts)
        finals = self._run(list(zip(prompts, params)), use_tqdm)
        return finals

    def chat(self, messages: Conversation | list[Conversation],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        prompts = [{"prompt_token_ids": render_chat(tok, conv, add_generation_prompt)} for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

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
            for prompt, params in items:
                req = engine.add_request(None, prompt, params)
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
                for out in engine.step():
                    if out.finished:
                        finals[out.request_id] = out
                        n_out += sum(len(c.token_ids) for c in out.outputs)
                        bar.update(1)
                        bar.set_postfix_str(f"output {n_out / (time.perf_counter() - start):.1f} tok/s")
        except RequestsFailed:
            for rid in ids:   # the failed requests are gone already; the others go with them
                engine.abort_request(rid)
            raise
        except BaseException:
            # A step failed half way (or Ctrl-C): the blocks it was writing may already be in the
            # prefix cache, so the KV bookkeeping starts afresh (all requests here are ours).
            engine.reset()
            raise
        finally:
            bar.close()
        return [finals[rid] for rid in ids]


def render_chat(tokenizer, conversation: Conversation, add_generation_prompt: bool = True) -> list[int]:
    """Token ids of a conversation rendered with the model's chat template."""
    if not conversation:
        raise ValueError("messages must not be empty")
    for m in conversation:
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
            raise ValueError(f"each message needs a role of system, user, assistant or tool; got {m!r}")
    ids = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)
