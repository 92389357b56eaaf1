"""Structured outputs against a hostile client (issue 34): the compile pool's time limit,
abandoned compiles, the cache's byte bound, schema depth and size limits, repeat caps, and
grammars that can match nothing. The compiler runs over the tests' tiny tokenizer (400 tokens),
so real xgrammar compiles stay fast; slow compiles are a real schema that is slow to compile
(tests/fault_server.py's slow_schema), or simulated by blocking `_compile`."""
from __future__ import annotations

import asyncio
import json
import os
import threading
import time

import pytest
import xgrammar

from pagedserve import LLM, InvalidRequestError, SamplingParams, StructuredOutputsParams
from pagedserve.config import EngineConfig, server_grammar_warmup
from pagedserve.server.app import make_engine_client
from pagedserve.server.config import ServerConfig
from pagedserve.structured.manager import GrammarCompiler
from tests.conftest import wait_for
from tests.fault_server import slow_schema

WAIT = 60   # seconds any future may take here before the test fails (never reached when it passes)


@pytest.fixture
def compiler(tiny_tokenizer):
    made = []

    def make(**kw):
        c = GrammarCompiler(tiny_tokenizer, len(tiny_tokenizer), [2], **kw)
        made.append(c)
        return c
    yield make
    for c in made:
        c.close()


@pytest.fixture
def blocked(monkeypatch):
    """`_compile` blocks until the event is set, for grammars whose text holds "slow"."""
    release = threading.Event()
    original = GrammarCompiler._compile

    def maybe_slow(self, ebnf, *args):
        if "slow" in ebnf:
            release.wait(WAIT)
        return original(self, ebnf, *args)
    monkeypatch.setattr(GrammarCompiler, "_compile", maybe_slow)
    yield release
    release.set()


def test_grammar_text_is_built_on_the_compile_pool_only(compiler, monkeypatch):
    """Converting a schema is proportional to its size (quadratic in xgrammar for bounded
    repeats): neither building the params nor compile() may do it on the caller's thread."""
    threads = []
    convert = xgrammar.Grammar.from_json_schema

    def recording(*a, **kw):
        threads.append(threading.current_thread().name)
        return convert(*a, **kw)
    monkeypatch.setattr(xgrammar.Grammar, "from_json_schema", staticmethod(recording))
    params = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    c = compiler()
    c.compile(params).result(WAIT)
    assert threads and all(t.startswith("pagedserve-grammar") for t in threads), threads


SLOW = slow_schema(1300)    # a real compile of about 3 s here, within every size limit


def alive(pid: int) -> bool:
    """The process exists and is not a zombie (the pool reaps what it kills)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_compile_over_the_time_limit_is_killed_with_its_process(compiler):
    """The compile runs in a child process that the time limit kills: the client gets a clear
    error, the compile does not run on (no orphan thread, the process is gone) and the next
    compile works."""
    c = compiler(num_threads=1, compile_timeout=0.3)
    assert c.compile(StructuredOutputsParams(regex="ab?")).result(WAIT) is not None   # its process started
    (pid,) = c._processes.pids
    with pytest.raises(InvalidRequestError, match="time limit") as e:
        c.compile(StructuredOutputsParams(json=SLOW)).result(WAIT)
    assert e.value.param == "structured_outputs"
    assert not alive(pid) and c._pool._orphans == 0
    assert c.compile(StructuredOutputsParams(regex="abc?")).result(WAIT) is not None
    assert pid not in c._processes.pids and all(alive(p) for p in c._processes.pids)


def test_an_abandoned_compile_is_killed_with_its_process(compiler):
    c = compiler(num_threads=1, compile_timeout=WAIT)
    c.compile(StructuredOutputsParams(regex="ab?")).result(WAIT)
    state = c.new_state(StructuredOutputsParams(json=SLOW))
    deadline = time.monotonic() + WAIT
    while not c._processes._busy and not state.compiled.done() and time.monotonic() < deadline:
        time.sleep(0.01)                           # until its child has the grammar
    assert not state.compiled.done()
    (pid,) = [child.pid for child in c._processes._busy]
    state.release()                                # its client left
    with pytest.raises(Exception, match="abandoned"):
        state.compiled.result(WAIT)
    deadline = time.monotonic() + WAIT
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not alive(pid)


def test_the_engine_fails_only_the_slow_request_and_keeps_no_block(tiny_llama):
    llm = LLM(tiny_llama.path, dtype="float32", num_gpu_blocks_override=64, structured_outputs_compile_timeout=0.3)
    try:
        slow = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(json=SLOW))
        with pytest.raises(Exception, match="time limit"):      # (RequestsFailed naming it)
            llm.generate(["a", "b"], [slow, SamplingParams(max_tokens=4)], use_tqdm=False)
        assert llm.kv_cache_stats()["num_used_blocks"] == 0
        llm.engine.check_paging_invariants()
        (out,) = llm.generate(["b"], SamplingParams(temperature=0, max_tokens=4,
                                                    structured_outputs=StructuredOutputsParams(choice=["yes", "no"])),
                              use_tqdm=False)
        assert out.outputs[0].text in ("yes", "no")
        pids = llm.engine.grammars._processes.pids
    finally:
        llm.shutdown()
    assert pids and not any(alive(p) for p in pids)     # shutdown kills the compile processes


def test_abandoned_compiles_do_not_hold_new_ones(compiler, blocked):
    c = compiler(num_threads=1, compile_timeout=0)
    states = [c.new_state(StructuredOutputsParams(grammar=f'root ::= "slow{i}"')) for i in range(4)]
    for s in states:
        s.release()                      # their clients left
    assert c.compile(StructuredOutputsParams(regex="quick")).result(WAIT) is not None
    for s in states:                     # the queued ones were dropped, not compiled
        with pytest.raises(Exception):
            s.compiled.result(WAIT)


def test_the_cache_is_bounded_in_bytes(compiler):
    c = compiler(max_cache_bytes=1)     # nothing fits: every finished compile is dropped from the cache
    for i in range(3):
        c.compile(StructuredOutputsParams(choice=[f"x{i}", "y"])).result(WAIT)
    assert c.cache_bytes <= 1 and c.num_cached == 0
    big = compiler(max_cache_bytes=1 << 30)
    futures = [big.compile(StructuredOutputsParams(choice=[f"x{i}", "y"])) for i in range(3)]
    for f in futures:
        f.result(WAIT)
    assert big.num_cached == 3 and big.cache_bytes > 0
    entry_bytes = big.cache_bytes // 3
    small = compiler(max_cache_bytes=2 * entry_bytes + entry_bytes // 2)
    for i in range(3):
        small.compile(StructuredOutputsParams(choice=[f"x{i}", "y"])).result(WAIT)
    assert small.num_cached == 2 and small.cache_bytes <= 2 * entry_bytes + entry_bytes // 2


def nested_arrays(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def nested_arrays_text(depth: int) -> str:
    return '{"type": "array", "items": ' * depth + '{"type": "integer"}' + "}" * depth


@pytest.mark.parametrize("schema", [nested_arrays(150), nested_arrays_text(300), "[" * 5000 + "]" * 5000,
                                    nested_arrays_text(5000)])
def test_deep_schemas_are_refused_not_a_recursion_error(schema):
    with pytest.raises(InvalidRequestError, match="deep") as e:
        StructuredOutputsParams(json=schema)
    assert e.value.param == "structured_outputs.json"


@pytest.mark.parametrize("kwargs", [{"json": {"type": "string", "pattern": ".{1,4588}"}},
                                    {"regex": "a{0,9000}"},
                                    {"json": {"type": "object", "properties": {
                                        f"p{i}": {"type": "string", "pattern": "[a-z]{1,400}"} for i in range(5)}}}])
def test_large_bounded_repeats_are_refused_when_built(kwargs):
    with pytest.raises(InvalidRequestError, match="repeat"):
        StructuredOutputsParams(**kwargs)


def test_a_grammar_over_the_size_cap_is_refused(compiler):
    with pytest.raises(InvalidRequestError, match="large"):
        compiler(max_grammar_bytes=10_000).compile(
            StructuredOutputsParams(json={"enum": [f"value{i}" for i in range(2000)]})).result(WAIT)


@pytest.mark.parametrize("grammar", ["root ::= root", 'root ::= a\na ::= a "x"'])
def test_a_grammar_that_matches_nothing_is_refused_at_compile(compiler, grammar):
    with pytest.raises(InvalidRequestError, match="matches no") as e:
        compiler().compile(StructuredOutputsParams(grammar=grammar)).result(WAIT)
    assert e.value.param == "structured_outputs.grammar"


def test_close_fails_queued_and_running_compiles_at_once(compiler, blocked):
    c = compiler(num_threads=1, compile_timeout=0)
    futures = [c.compile(StructuredOutputsParams(grammar=f'root ::= "slow{i}"')) for i in range(3)]
    c.close()
    for f in futures:
        with pytest.raises(Exception, match="shutting down"):
            f.result(WAIT)


def test_failed_constraints_count_against_the_cache_too(compiler):
    """A refused constraint stays cached (a repeat is refused at once) but its text counts: a
    flood of distinct bad ones cannot grow the cache past its bytes."""
    c = compiler(max_cache_bytes=4000)
    for i in range(30):
        f = c.compile(StructuredOutputsParams(grammar=f"root ::= r{i}\nr{i} ::= r{i}"))
        with pytest.raises(InvalidRequestError):
            f.result(WAIT)
    assert c.cache_bytes <= 4000 and len(c._cache) < 30
    assert c.num_compiles == 30
    again = c.compile(StructuredOutputsParams(grammar="root ::= r29\nr29 ::= r29"))
    assert again.done() and c.num_compiles == 30    # refused again at once, not recompiled


def test_the_engine_warms_the_grammar_compiler_and_its_process_at_start(tiny_llama):
    """structured_outputs_warmup: at start a daemon thread builds the compiler and a compile
    process, which the first structured request then uses (no process of its own started)."""
    llm = LLM(tiny_llama.path, dtype="float32", num_gpu_blocks_override=64, structured_outputs_warmup=True)
    try:
        engine = llm.engine
        wait_for(lambda: engine._grammars is not None and engine._grammars.processes is not None
                  and engine._grammars.processes.idle_pids, "a warmed compile process", timeout=WAIT)
        (warm,) = engine.grammars.processes.idle_pids
        assert engine.grammars._compiler is not None and engine.grammars.num_compiles == 0
        params = SamplingParams(temperature=0, max_tokens=4,
                                structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
        (out,) = llm.generate(["b"], params, use_tqdm=False)
        assert out.outputs[0].text in ("yes", "no")
        assert engine.grammars.processes.pids == [warm]          # the trial compile ran in it
    finally:
        llm.shutdown()
    assert not alive(warm)


def test_an_engine_that_never_compiles_shuts_its_warm_up_down(tiny_llama):
    """Shut down while the warm-up's process starts, or after it is ready: no process is left."""
    for wait_ready in (False, True):
        llm = LLM(tiny_llama.path, dtype="float32", num_gpu_blocks_override=64, structured_outputs_warmup=True)
        engine = llm.engine
        wait_for(lambda: engine._grammars is not None and engine._grammars.processes is not None
                  and (engine._grammars.processes.idle_pids if wait_ready else engine._grammars.processes.pids),
                  "a compile process", timeout=WAIT)
        pids = engine.grammars.processes.pids
        llm.shutdown()
        assert pids and not any(alive(p) for p in pids)
    off = LLM(tiny_llama.path, dtype="float32", num_gpu_blocks_override=64)   # offline: no warm-up by default
    assert off.engine.config.structured_outputs_warmup is None and off.engine._grammars is None
    off.shutdown()


def test_the_server_warms_up_unless_the_environment_says_0(tiny_llama, monkeypatch):
    """The server's engine (make_engine_client) warms up by default; offline engines do not."""
    monkeypatch.setenv("PAGEDSERVE_GRAMMAR_WARMUP", "0")        # (the tests' setting: conftest.py)
    assert not server_grammar_warmup()
    monkeypatch.delenv("PAGEDSERVE_GRAMMAR_WARMUP")

    async def serve() -> list[int]:
        config = EngineConfig(model=tiny_llama.path, dtype="float32", num_gpu_blocks_override=64)
        llm, _ = make_engine_client(config, ServerConfig())
        llm.start()
        await llm.wait_started()
        try:
            assert config.structured_outputs_warmup is True
            deadline = time.monotonic() + WAIT
            while not (llm.engine._grammars and llm.engine._grammars.processes
                       and llm.engine._grammars.processes.idle_pids):
                assert time.monotonic() < deadline, "never: a warmed compile process"
                await asyncio.sleep(0.02)
            return llm.engine.grammars.processes.pids
        finally:
            await llm.shutdown()
    pids = asyncio.run(serve())
    assert pids and not any(alive(p) for p in pids)
