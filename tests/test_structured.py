"""Structured outputs (offline): the default model at temperature 1.0, 20 seeds per constraint,
batched in one generate call each. Unconstrained, the same model rarely writes valid JSON (shown
below), so these tests fail if the grammar's bitmask is not applied."""
import json
import re
import threading

import jsonschema
import pytest
import torch

from pagedserve import LLM, InvalidRequestError, SamplingParams, StructuredOutputsParams
from pagedserve.batch import SamplingSettings
from pagedserve.models.loader import default_model_path
from pagedserve.sampling.sampler import Sampler, SamplingRow
from pagedserve.structured.manager import GrammarCompiler

SEEDS = range(20)
PROMPT = "Describe a person as JSON with name, age, tags and address:"

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 10},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"]},
    },
    "required": ["name", "age", "role", "tags", "address"],
}

# Arithmetic over small integers; Python's own parser checks the outputs.
ARITHMETIC = r'''
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= num | "(" expr ")"
num ::= [1-9] [0-9]?
'''


@pytest.fixture(scope="module")
def llm():
    try:
        path = default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return LLM(path, num_gpu_blocks_override=512)


def run(llm, constraint: StructuredOutputsParams | None, max_tokens: int, prompt: str = PROMPT, **kw):
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=max_tokens, structured_outputs=constraint, **kw)
              for s in SEEDS]
    return [o.outputs[0] for o in llm.generate([prompt] * len(params), params, use_tqdm=False)]


def valid_json(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def assert_no_blocks_held(llm):
    stats = llm.kv_cache_stats()
    assert stats["num_used_blocks"] == 0
    llm.engine.check_paging_invariants()


def test_json_schema_outputs_validate_and_unconstrained_ones_do_not(llm):
    unconstrained = run(llm, None, 40)
    assert sum(valid_json(c.text, PERSON) for c in unconstrained) <= 1
    outs = run(llm, StructuredOutputsParams(json=PERSON), 120)
    for c in outs:
        assert valid_json(c.text, PERSON), c.text
        assert c.finish_reason == "stop"
    assert len({c.text for c in outs}) > 10      # sampled, not one forced answer
    assert_no_blocks_held(llm)


def test_regex_choice_grammar_and_json_object(llm):
    for c in run(llm, StructuredOutputsParams(regex=r"[A-Z][a-z]{1,6}-[0-9]{2,4}"), 16, "A product code:"):
        assert re.fullmatch(r"[A-Z][a-z]{1,6}-[0-9]{2,4}", c.text), c.text
    choices = ["Paris", "London", "Tokyo", "a longer answer"]
    outs = run(llm, StructuredOutputsParams(choice=choices), 24, "The best city is")
    assert all(c.text in choices for c in outs) and len({c.text for c in outs}) > 1
    for c in run(llm, StructuredOutputsParams(grammar=ARITHMETIC), 24, "A sum:"):
        if c.finish_reason == "stop":
            compile(c.text, "<grammar>", "eval")   # a SyntaxError fails the test
            assert re.fullmatch(r"[0-9+\-*/()]+", c.text), c.text
        else:   # cut by max_tokens: still a prefix of the language
            assert re.fullmatch(r"[0-9+\-*/()]*", c.text), c.text
    for c in run(llm, StructuredOutputsParams(json_object=True), 60, "A JSON object:"):
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.text), dict), c.text
        else:
            assert c.text.startswith("{")


def test_parallel_sampling_forks_the_matcher(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=120,
                            structured_outputs=StructuredOutputsParams(json=PERSON))
    (out,) = llm.generate([PROMPT], params, use_tqdm=False)
    assert len(out.outputs) == 3
    for c in out.outputs:
        assert valid_json(c.text, PERSON), c.text


def test_preemption_in_the_middle_of_a_constrained_sequence():
    """A KV cache too small for all 20 at once: sequences are preempted (recompute) mid-way and
    their outputs still validate."""
    try:
        path = default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    llm = LLM(path, num_gpu_blocks_override=24, block_size=16)
    outs = run(llm, StructuredOutputsParams(json=PERSON), 120)
    assert llm.kv_cache_stats()["num_preemptions"] > 0
    for c in outs:
        assert valid_json(c.text, PERSON), c.text
    assert_no_blocks_held(llm)


def test_grammars_compile_off_the_engine_thread_and_are_cached(llm, monkeypatch):
    """A request whose grammar is still compiling waits in the queue while others run; the same
    constraint is compiled once."""
    engine = llm.engine
    release = threading.Event()
    compile_grammar = GrammarCompiler._compile

    def slow_compile(self, ebnf, *args):
        release.wait(60)
        return compile_grammar(self, ebnf, *args)

    monkeypatch.setattr(GrammarCompiler, "_compile", slow_compile)
    constraint = StructuredOutputsParams(regex="(ab)+c")   # not compiled before in this module
    before = engine.grammars.num_compiles
    waiting = [engine.add_request(None, "Letters:", SamplingParams(temperature=1.0, seed=i, max_tokens=12,
                                                                     structured_outputs=constraint))
               for i in range(2)]
    free = engine.add_request(None, "Hello", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert engine.grammars.num_compiles == before + 1
    while free.request_id in engine.requests:
        assert not engine.only_waiting_for_grammars()
        engine.step()
    assert all(r.seqs[0].num_output_tokens == 0 and r.waiting_for_grammar for r in waiting)
    assert engine.only_waiting_for_grammars()
    release.set()
    while engine.has_unfinished_requests():
        if engine.only_waiting_for_grammars():
            engine.wait_for_grammars(60)
        engine.step()
    for r in waiting:
        assert re.fullmatch(r"(ab)+c", engine.tokenizer.decode(r.seqs[0].output_token_ids, skip_special_tokens=True))
    assert_no_blocks_held(llm)


def test_a_grammar_that_fails_to_compile_fails_its_request_only(llm, monkeypatch):
    def broken(self, ebnf, *args):
        raise RuntimeError("compiler exploded")
    monkeypatch.setattr(GrammarCompiler, "_compile", broken)
    bad = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="x{2}y"))
    with pytest.raises(Exception, match="compiler exploded"):
        llm.generate(["a", "b"], [bad, SamplingParams(max_tokens=4)], use_tqdm=False)
    assert_no_blocks_held(llm)
    (out,) = llm.generate(["b"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert out.finished


@pytest.mark.parametrize("kwargs, param", [
    ({"json": {"type": "nope"}}, "structured_outputs.json"),
    ({"json": "{not json"}, "structured_outputs.json"),
    ({"json": {"type": "object", "properties": {"a": {"type": "string", "minLength": "x"}}}},
     "structured_outputs.json"),
    ({"regex": "(unclosed"}, "structured_outputs.regex"),
    ({"choice": []}, "structured_outputs.choice"),
    ({"grammar": "root ::= "}, "structured_outputs.grammar"),
    ({"grammar": "start ::= \"a\""}, "structured_outputs.grammar"),   # no root rule
    ({}, "structured_outputs"),
    ({"regex": "a", "choice": ["a"]}, "structured_outputs"),
])
def test_bad_constraints_are_refused_when_built(kwargs, param):
    with pytest.raises(InvalidRequestError) as e:
        StructuredOutputsParams(**kwargs)
    assert e.value.param == param


def test_the_sampler_applies_the_bitmask_to_its_rows_only():
    """Row 0 may only sample token 37 (bit 5 of word 1); row 1 is unconstrained."""
    import numpy as np
    logits = torch.zeros(2, 70)
    logits[:, 3] = 10.0
    bitmask = np.zeros((1, 3), dtype=np.int32)
    bitmask[0, 1] = 1 << 5
    settings = SamplingSettings(temperature=0.0)
    rows = [SamplingRow(settings, 0, None, None, None) for _ in range(2)]
    out = Sampler(set()).__call__(logits, rows, [0], bitmask)
    assert out.token_ids == [37, 3]


def test_the_benchmark_runs(llm):
    """benchmarks/structured.py on a tiny setting (no timing is checked): the constrained runs
    fill and apply a bitmask every decode step, the unconstrained ones never."""
    from benchmarks.structured import run as run_benchmark
    result = run_benchmark(llm, [1, 2], 3)
    for row in result["rows"]:
        assert row["unconstrained"]["fill_ms"] == row["unconstrained"]["apply_ms"] == 0
        assert row["constrained"]["fill_ms"] > 0 and row["constrained"]["apply_ms"] > 0
    assert set(result["compile"]) == {"tokenizer_info_ms", "first_compile_ms", "cached_ms"}
    assert_no_blocks_held(llm)


def test_chat_shows_tools_to_templates_that_take_them(llm):
    import copy
    from pagedserve.engine.llm import render_chat
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                               "parameters": {"type": "object", "properties": {}}}}]
    conv = [{"role": "user", "content": "Weather?"}]
    tok = copy.deepcopy(llm.get_tokenizer())
    tok.chat_template = "{% for t in tools or [] %}{{ t.function.name }};{% endfor %}{{ messages[0].content }}"
    assert tok.decode(render_chat(tok, conv, tools=tools)) == "get_weather;Weather?"
    assert tok.decode(render_chat(tok, conv)) == "Weather?"
    (out,) = llm.chat(conv, SamplingParams(max_tokens=4, temperature=0), use_tqdm=False, tools=tools)
    assert out.finished
