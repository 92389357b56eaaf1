"""--reasoning-parser: a `<think>...</think>` block as the chat message's reasoning_content, plain
and streamed (the openai client against a server on the tiny model, whose output a regex
constraint shapes into a think block), a block cut by max_tokens, and the splitter on every way
of cutting a text into stream deltas."""
from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.server.reasoning import ReasoningStreamer, split_reasoning
from tests.conftest import examples
from tests.server_utils import api_server_args, openai_client, served

THINK = r"<think>[a-z ]{4,12}</think>\n[a-z ]{3,10}"


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    yield from served(tiny_llama.path, tmp_path_factory.mktemp("reasoning"),
                      api_server_args("--reasoning-parser", "qwen3"))


def _chat(client, regex: str, max_tokens: int = 40, stream: bool = False):
    return client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Think, then answer."}], temperature=0,
        max_tokens=max_tokens, stream=stream, extra_body={"structured_outputs": {"regex": regex}})


def test_the_think_block_is_reasoning_content_plain_and_streamed(server):
    client = openai_client(server)
    msg = _chat(client, THINK).choices[0].message
    assert re.fullmatch(r"[a-z ]{4,12}", msg.reasoning_content), msg
    assert re.fullmatch(r"\n[a-z ]{3,10}", msg.content), msg
    reasoning, content, finish = "", "", None
    for chunk in _chat(client, THINK, stream=True):
        for choice in chunk.choices:
            delta = choice.delta
            reasoning += getattr(delta, "reasoning_content", None) or ""
            content += delta.content or ""
            finish = choice.finish_reason or finish
    assert (reasoning, content, finish) == (msg.reasoning_content, msg.content, "stop")


def test_a_think_block_cut_by_max_tokens_is_all_reasoning(server):
    client = openai_client(server)
    choice = _chat(client, r"<think>[a-z ]{30,60}</think>answer", max_tokens=8).choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.content is None and re.fullmatch(r"[a-z ]+", choice.message.reasoning_content)
    reasoning, content = "", ""
    for chunk in _chat(client, r"<think>[a-z ]{30,60}</think>answer", max_tokens=8, stream=True):
        for c in chunk.choices:
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            content += c.delta.content or ""
    assert (reasoning, content) == (choice.message.reasoning_content, "")


def test_output_without_a_block_is_content(server):
    msg = _chat(openai_client(server), r"[a-z]{3,6} done").choices[0].message
    assert msg.reasoning_content is None and re.fullmatch(r"[a-z]{3,6} done", msg.content)


@pytest.mark.parametrize("parser, text, expected", [
    ("qwen3", "<think>a b</think>\n\nanswer", ("a b", "\n\nanswer")),
    ("qwen3", "no block at all", (None, "no block at all")),
    ("qwen3", "<think>cut off", ("cut off", None)),
    ("qwen3", "<thi", (None, "<thi")),
    ("deepseek_r1", "reasoning</think>answer", ("reasoning", "answer")),
    ("deepseek_r1", "<think>reasoning</think>answer", ("reasoning", "answer")),
    ("deepseek_r1", "cut off inside the block", ("cut off inside the block", None)),
    ("deepseek_r1", "</think>", (None, None)),
])
def test_split_reasoning(parser, text, expected):
    assert split_reasoning(parser, text) == expected


@settings(max_examples=examples(200))
@given(st.sampled_from(["qwen3", "deepseek_r1"]),
       st.lists(st.sampled_from(["<think>", "</think>", "<", "</", "think", ">", "a", " b", "\n"]), max_size=12),
       st.data())
def test_streamed_deltas_join_to_the_whole_split(parser, pieces, data):
    """However the text is cut into deltas, the deltas of each kind join to the whole text's split."""
    text = "".join(pieces)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    parts = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    streamer = ReasoningStreamer(parser)
    reasoning, content = "", ""
    for i, part in enumerate(parts):
        r, c = streamer.feed(part, finished=i == len(parts) - 1)
        reasoning, content = reasoning + (r or ""), content + (c or "")
    whole = split_reasoning(parser, text)
    assert (reasoning or None, content or None) == whole
