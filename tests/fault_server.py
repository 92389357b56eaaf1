"""Faults injected into the engine, for the tests and the reliability benchmark.

A request whose prompt text contains one of the markers below meets a fault:
REQUEST_FAULT raises while its own tokens are handled (after its second token),
STEP_FAULT raises in the model step that runs it (the whole step fails), and
FATAL_FAULT breaks the engine outside any request (reading the KV stats raises
once it is queued). A prompt given as token ids (chat, /v1/responses) is marked by its
decoded text. SLOW_STEPS is no fault: every model step that runs such a request
takes at least 20 ms longer, so a test can hold requests running for a known time. `install()` patches the classes of this process;
`python -m tests.fault_server serve ...` runs the server with them installed.
"""
from __future__ import annotations

import functools
import json
import os
import sys
import time

from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.scheduler import Scheduler
from pagedserve.structured.manager import GrammarCompiler
from pagedserve.worker.model_runner import ModelRunner

REQUEST_FAULT = "FAULT-IN-ONE-REQUEST"
STEP_FAULT = "FAULT-IN-THE-STEP"
FATAL_FAULT = "FAULT-OUTSIDE-ANY-REQUEST"
SLOW_STEPS = "SLOW-STEPS"
SLOW_STEP_SECONDS = 0.02
# A grammar holding this string is compiled as slow_grammar() instead: a real compile of about
# 15 s on the tiny model's vocabulary (xgrammar's compile cannot be interrupted in a process: the
# time limit must kill its child process, and abandonment too).
SLOW_COMPILE = "SLOW-COMPILE"
SLOW_COMPILE_PROPERTIES = 3000
# A chat whose message holds this string takes SLOW_RENDER_SECONDS to render (a huge template).
SLOW_RENDER = "SLOW-RENDER"
SLOW_RENDER_SECONDS = 30.0
# A chat whose message holds HOLD_RENDER followed by a path (up to the next space) renders only once
# that path exists; it writes PATH.held when it starts waiting (a test holds the tokenizer lane
# for exactly as long as it wants, then creates the path; at most HOLD_RENDER_SECONDS).
HOLD_RENDER = "HOLD-RENDER:"
HOLD_RENDER_SECONDS = 120.0


class InjectedFault(RuntimeError):
    pass


def slow_schema(properties: int) -> dict:
    """A JSON schema that is slow to compile, within every size limit at 1300 properties (about
    240 kB of grammar): required string properties, each with a pattern. xgrammar's compile grows
    faster than linearly in them (tiny vocabulary, 2 busy cores: 1300 about 3 s, 3000 about 15 s;
    the default model's: 1000 about 17 s)."""
    return {"type": "object", "required": [f"p{i}" for i in range(properties)],
            "properties": {f"p{i}": {"type": "string", "pattern": "[a-z0-9_]+[^x]*"} for i in range(properties)}}


@functools.cache
def slow_grammar() -> str:
    import xgrammar as xgr
    return str(xgr.Grammar.from_json_schema(json.dumps(slow_schema(SLOW_COMPILE_PROPERTIES)), any_whitespace=False))


def hold_until(path: str) -> None:
    """Say (PATH.held) that a render waits, then wait until `path` exists."""
    with open(path + ".held", "a") as f:
        f.write("held\n")
    deadline = time.monotonic() + HOLD_RENDER_SECONDS
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)


def _marked(req, marker: str) -> bool:
    return marker in (req.prompt or "")


def install(patch=None) -> None:
    """Patch the Scheduler (which appends tokens), ModelRunner and LLMEngine; `patch(obj, name,
    value)` (pytest's monkeypatch.setattr) undoes it after a test, setattr makes it for good.
    The worker sees only seq ids, so the step faults find their requests by the sequences
    the batch names."""
    patch = patch or setattr
    append_token, execute, kv_cache_stats = Scheduler._append_token, ModelRunner.execute, LLMEngine.kv_cache_stats
    marked: dict[str, set[int]] = {}   # marker -> seq ids of marked requests in the latest schedule()
    schedule = Scheduler.schedule

    def faulty_append_token(self, req, seq, sample, row):
        if _marked(req, REQUEST_FAULT) and seq.num_output_tokens >= 2:
            raise InjectedFault("injected fault in one request")
        return append_token(self, req, seq, sample, row)

    def marking_schedule(self):
        out = schedule(self)
        for marker in (STEP_FAULT, SLOW_STEPS):
            marked[marker] = {s.seq.seq_id for s in out.scheduled if _marked(s.request, marker)}
        return out

    def faulty_execute(self, batch):
        if any(s.seq_id in marked[STEP_FAULT] for s in batch.seqs):
            raise InjectedFault("injected fault in a model step")
        if any(s.seq_id in marked[SLOW_STEPS] for s in batch.seqs):
            time.sleep(SLOW_STEP_SECONDS)
        return execute(self, batch)

    def faulty_kv_cache_stats(self):
        if any(_marked(req, FATAL_FAULT) for req in self.requests.values()):
            raise InjectedFault("injected fault outside any request")
        return kv_cache_stats(self)

    patch(Scheduler, "_append_token", faulty_append_token)
    patch(Scheduler, "schedule", marking_schedule)
    patch(ModelRunner, "execute", faulty_execute)
    patch(LLMEngine, "kv_cache_stats", faulty_kv_cache_stats)
    tokenize_prompt = LLMEngine.tokenize_prompt

    def text_of_every_prompt(self, prompt):     # so that rendered chats carry their markers
        text, ids = tokenize_prompt(self, prompt)
        if text is None and all(isinstance(t, int) and 0 <= t < self.vocab_size for t in ids):
            text = self.tokenizer.decode(ids)    # (bad ids are left to the engine's validation)
        return text, ids
    patch(LLMEngine, "tokenize_prompt", text_of_every_prompt)
    compile_grammar = GrammarCompiler._compile

    def slow_compile(self, ebnf, *args):
        return compile_grammar(self, slow_grammar() if SLOW_COMPILE in ebnf else ebnf, *args)
    patch(GrammarCompiler, "_compile", slow_compile)
    from pagedserve.server import serving
    render_chat = serving.render_chat

    def slow_render(tokenizer, conversation, *args, **kwargs):
        if any(SLOW_RENDER in str(m.get("content")) for m in conversation):
            time.sleep(SLOW_RENDER_SECONDS)
        for m in conversation:
            if HOLD_RENDER in str(m.get("content")):
                hold_until(str(m.get("content")).split(HOLD_RENDER, 1)[1].split(" ", 1)[0])
        return render_chat(tokenizer, conversation, *args, **kwargs)
    patch(serving, "render_chat", slow_render)


if __name__ == "__main__":
    from pagedserve.cli import main
    install()
    sys.exit(main())
