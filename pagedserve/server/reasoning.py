"""Reasoning output: a model's `<think>...</think>` block as `reasoning_content`, the rest as
`content` (vLLM's --reasoning-parser; chat completions, plain and streamed).

- `qwen3`: the block is reasoning only where the output opens it with `<think>`; output without
  one (Qwen3 with enable_thinking false: its template closes an empty block in the prompt) is
  all content.
- `deepseek_r1`: the output starts inside the block (DeepSeek-R1's template opens it in the
  prompt; a `<think>` the model writes anyway is dropped): everything before `</think>` is
  reasoning.
A block cut off before `</think>` (max_tokens) is reasoning, with no content. The text inside
and after the tags is kept as written (no whitespace stripped), as vLLM keeps it.
"""
from __future__ import annotations

REASONING_PARSERS = ("qwen3", "deepseek_r1")
THINK_START, THINK_END = "<think>", "</think>"


def split_reasoning(parser: str, text: str) -> tuple[str | None, str | None]:
    """(reasoning_content, content) of a whole output."""
    streamer = ReasoningStreamer(parser)
    reasoning, content = streamer.feed(text, finished=True)
    return reasoning, content


def _held_prefix(text: str, tag: str) -> int:
    """How many trailing characters of `text` could be the start of `tag` (held back until the
    next delta says whether the tag follows)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningStreamer:
    """Splits an output's text deltas into reasoning and content deltas. A tag split between
    deltas is held back until it is whole (or the output ends)."""

    def __init__(self, parser: str) -> None:
        if parser not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r}; choose from {', '.join(REASONING_PARSERS)}")
        self.parser = parser
        # "start": before the output's first characters say whether a block opens (qwen3, and
        # deepseek_r1's optional <think>); "reasoning": inside the block; "content": after it.
        self.state = "start"
        self.pending = ""

    def feed(self, delta: str, finished: bool = False) -> tuple[str | None, str | None]:
        """(reasoning delta, content delta) for this text delta; None where there is none."""
        text, self.pending = self.pending + delta, ""
        reasoning, content = [], []
        while text:
            if self.state == "start":
                if text.startswith(THINK_START):
                    text, self.state = text[len(THINK_START):], "reasoning"
                elif THINK_START.startswith(text) and not finished:
                    self.pending, text = text, ""          # maybe the tag, not yet whole
                else:
                    self.state = "reasoning" if self.parser == "deepseek_r1" else "content"
            elif self.state == "reasoning":
                end = text.find(THINK_END)
                if end >= 0:
                    reasoning.append(text[:end])
                    text, self.state = text[end + len(THINK_END):], "content"
                    continue
                held = 0 if finished else _held_prefix(text, THINK_END)
                reasoning.append(text[:len(text) - held])
                self.pending, text = text[len(text) - held:], ""
            else:
                content.append(text)
                text = ""
        return "".join(reasoning) or None, "".join(content) or None
