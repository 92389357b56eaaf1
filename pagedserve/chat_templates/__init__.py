"""Chat templates shipped with pagedserve (package data), selectable by name where a template
is asked for (`--chat-template hermes`, `LLM(chat_template="hermes")`, `LLM.chat(chat_template=...)`).

- `hermes`: ChatML (SmolLM2's, Hermes' and Qwen2's turn format) with tool calling: the tools
  in the system turn, calls as <tool_call>{"name", "arguments"}</tool_call> (the hermes
  parser's format), answers as <tool_response>. Many small models' own templates (SmolLM2's
  among them) drop `tools`; this one shows them.
"""
from __future__ import annotations

from importlib import resources

SHIPPED = ("hermes",)


def shipped_template(name: str) -> str | None:
    """The shipped template called `name` (also `name.jinja`, `tool_chat_template_name.jinja`), or None."""
    stem = name.removesuffix(".jinja").removeprefix("tool_chat_template_")
    if stem not in SHIPPED:
        return None
    return resources.files(__package__).joinpath(f"{stem}.jinja").read_text()


def renders_tools(template: str | None) -> bool:
    """Whether a chat template can show `tools` at all (it names the variable). A template that
    does not never shows the model the tools, so tool_choice auto cannot work with it."""
    return template is not None and "tools" in str(template)


_warned: set[str] = set()
WARNING_HEADER = "Warning"


def tools_warning(template: str | None, logger) -> str | None:
    """For a request with tools: the warning that the template shows none of them (logged once
    per template), or None. The server sends it in a `Warning` header."""
    if renders_tools(template):
        return None
    message = ("the chat template renders no tools, so the model is not shown them and tool_choice auto will not "
               "call one; serve with --chat-template hermes (shipped) or another template that shows tools")
    key = str(template)
    if key not in _warned:
        _warned.add(key)
        logger.warning("%s (logged once)", message)
    return message


def warning_headers(message: str | None) -> dict[str, str]:
    return {WARNING_HEADER: f'299 pagedserve "{message}"'} if message else {}
