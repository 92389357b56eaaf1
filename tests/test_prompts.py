"""server/prompts.py on its own: the cheap limits refuse before any tokenizing, with the
OpenAI param at fault, and the tokenizer runs on the processor's one worker thread."""
from __future__ import annotations

import asyncio
import json
import threading

import pytest

from pagedserve.engine.protocol import check_num_prompts
from pagedserve.server.errors import APIError
from pagedserve.server.prompts import PromptProcessor, context_length_error

MAX_LEN = 64


@pytest.fixture(scope="module")
def processor(tiny_llama):
    p = PromptProcessor(tiny_llama.tokenizer, MAX_LEN, lambda n: check_num_prompts(n, 3))
    yield p
    p.close()


def refused(fn, *args) -> APIError:
    with pytest.raises(APIError) as e:
        fn(*args)
    assert e.value.status == 400
    return e.value


def test_the_context_limit_names_the_param_and_the_openai_code(processor):
    processor.check_context(MAX_LEN - 1, "prompt")
    err = refused(processor.check_context, MAX_LEN, "messages")
    assert (err.param, err.code) == ("messages", "context_length_exceeded") and str(MAX_LEN) in err.message
    assert context_length_error(70, MAX_LEN, "prompt").code == "context_length_exceeded"


def test_the_character_limit_is_the_context_times_the_longest_token(processor, tiny_llama):
    longest = max(len(t) for t in tiny_llama.tokenizer.get_vocab())
    assert processor.max_chars == MAX_LEN * longest
    processor.check_chars(processor.max_chars, "prompt")
    assert refused(processor.check_chars, processor.max_chars + 1, "prompt").code == "context_length_exceeded"


def test_the_prompt_count_is_the_clients_check_as_a_400(processor):
    processor.check_num_prompts(3)
    err = refused(processor.check_num_prompts, 4, "input")
    assert err.param == "input" and "at most 3" in err.message


def test_a_completion_body_is_prechecked_before_validation(processor):
    precheck = processor.precheck_completion_body
    precheck(json.dumps({"prompt": "text"}).encode())           # text: left to the tokenizer
    precheck(json.dumps({"prompt": [1, 2, 3]}).encode())
    precheck(b"{not json")                                      # left to the validation to describe
    precheck(json.dumps(["not", "a", "dict"]).encode())
    assert refused(precheck, json.dumps({"prompt": [[1]] * 4}).encode()).param == "prompt"
    assert refused(precheck, json.dumps({"prompt": [5] * MAX_LEN}).encode()).code == "context_length_exceeded"
    assert refused(precheck, json.dumps({"prompt": [[1], [5] * MAX_LEN]}).encode()).code == "context_length_exceeded"


def test_encoding_runs_on_the_one_worker_thread_and_matches_the_tokenizer(processor, tiny_llama):
    texts = ["Once upon a time", "there was a tiny model"]

    async def main():
        ids = await processor.encode(texts)
        no_special = await processor.encode(texts[:1], add_special_tokens=False)
        threads = {await processor.run(lambda: threading.current_thread().name) for _ in range(3)}
        assert await processor.encode([]) == []
        return ids, no_special, threads
    ids, no_special, threads = asyncio.run(main())
    assert ids == [tiny_llama.tokenizer.encode(t) for t in texts]
    assert no_special == [tiny_llama.tokenizer.encode(texts[0], add_special_tokens=False)]
    assert len(threads) == 1 and threads.pop().startswith("pagedserve-tokenizer")
    err = refused(lambda: asyncio.run(processor.encode(["x" * (processor.max_chars + 1)], "input")))
    assert err.param == "input"


def test_chat_rendering_checks_the_text_parts_first(processor):
    class Message:
        def __init__(self, content):
            self.content = content

    calls = []

    def render(tokenizer, messages, *args):
        calls.append(args)
        return [1, 2]

    async def main(messages):
        return await processor.render_chat(render, messages, "extra")
    assert asyncio.run(main([Message("hi"), Message([{"type": "text", "text": "there"}, {"type": "image"}])])) == [1, 2]
    assert calls == [("extra",)]
    too_long = [Message([{"type": "text", "text": "x" * (processor.max_chars + 1)}])]
    err = refused(lambda: asyncio.run(main(too_long)))
    assert err.param == "messages" and calls == [("extra",)]   # refused before rendering
