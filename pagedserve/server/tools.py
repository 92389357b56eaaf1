"""Tool calling for /v1/chat/completions: `tools` and `tool_choice` to a constraint, and the
generated text back to `tool_calls`, whole or as streamed deltas.

- "none": the tools are only shown to the model (through its chat template, if it takes them).
- a named function: the output is constrained to that function's `parameters` schema and is
  returned as one call with those arguments.
- "required": the output is constrained to a JSON array of one or more
  {"name": <a tool's name>, "parameters": <its arguments>} (one only if parallel_tool_calls is
  false), returned as that many calls.
- "auto" (the default when tools are given): only with --enable-auto-tool-choice and a
  --tool-call-parser; the output is free and the parser finds the calls in it. `hermes`: each
  call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, the rest is content.
A response with calls finishes with "tool_calls".
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from pagedserve.server.errors import bad_request
from pagedserve.server.protocol import (ChatCompletionRequest, DeltaFunctionCall, DeltaToolCall, FunctionCall,
                                        ToolCall, random_id)

TOOL_CALL_PARSERS = ("hermes",)
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass
class ToolPlan:
    mode: str                                   # none | named | required | auto
    tools: list[dict[str, Any]]                 # for the chat template
    constraint: dict[str, Any] | None = None    # StructuredOutputsParams' arguments
    name: str | None = None                     # the named function


def plan_tools(body: ChatCompletionRequest, auto_tool_choice: bool, parser: str | None) -> ToolPlan | None:
    """What the request's tools ask for (400 for anything malformed), or None without tools."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    functions = _functions(body.tools)
    if choice is None:
        choice = "auto"
    if choice == "none":
        return ToolPlan("none", body.tools)
    if choice == "auto":
        if not (auto_tool_choice and parser):
            raise bad_request('"auto" tool choice needs the server started with --enable-auto-tool-choice and '
                              '--tool-call-parser; or set tool_choice to "none", "required" or a named function',
                              "tool_choice")
        return ToolPlan("auto", body.tools)
    if choice == "required":
        return ToolPlan("required", body.tools, {"json": _required_schema(functions, body.parallel_tool_calls)})
    if isinstance(choice, dict):
        name = _named_choice(choice)
        if name not in functions:
            raise bad_request(f'tool_choice must be "none", "auto", "required" or {{"type": "function", '
                              f'"function": {{"name": NAME}}}} naming one of the tools ({", ".join(functions)})',
                              "tool_choice")
        return ToolPlan("named", body.tools, {"json": functions[name]}, name)
    raise bad_request(f'tool_choice must be "none", "auto", "required" or a named function; got {choice!r}',
                      "tool_choice")


_NAMED = '{"type": "function", "function": {"name": NAME}}'
_DEFS = ("$defs", "definitions")   # where schemas keep what "$ref": "#/$defs/..." points to


def _named_choice(choice: dict[str, Any]) -> str:
    """The function a tool_choice object names (400 for any other shape)."""
    if choice.get("type") != "function":
        raise bad_request(f"tool_choice as an object must be {_NAMED}; its type is {choice.get('type')!r}",
                          "tool_choice")
    fn = choice.get("function")
    if not isinstance(fn, dict):
        raise bad_request(f"tool_choice.function must be an object {{\"name\": NAME}}; got {type(fn).__name__}",
                          "tool_choice")
    name = fn.get("name")
    if not isinstance(name, str):
        raise bad_request(f"tool_choice.function.name must be a string; got {type(name).__name__}", "tool_choice")
    return name


def _required_schema(functions: dict[str, dict], parallel: bool) -> dict:
    """tool_choice "required": an array of {"name", "parameters"} calls. Each tool's $defs move to
    the top of the array's schema, where the tools' "#/$defs/..." references resolve."""
    defs: dict[str, dict[str, Any]] = {}
    calls = []
    for name, params in functions.items():
        params = dict(params)
        for where in _DEFS:
            hoisted = params.pop(where, None)
            if hoisted is None:
                continue
            if not isinstance(hoisted, dict):
                raise bad_request(f"the parameters of tool {name!r}: {where} must be an object", "tools")
            for key, value in hoisted.items():
                if key in defs.setdefault(where, {}) and defs[where][key] != value:
                    raise bad_request(f"tools define {where}/{key} differently ({name!r} and another); with "
                                      f'tool_choice "required" their definitions share one namespace', "tools")
                defs[where][key] = value
        calls.append({"type": "object", "properties": {"name": {"const": name}, "parameters": params},
                      "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    schema.update(defs)
    return schema


def _functions(tools: list[dict[str, Any]]) -> dict[str, dict]:
    """name -> parameters schema of each function tool."""
    out: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise bad_request(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}", "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise bad_request(f"tools[{i}].function.name must be 1-64 letters, digits, _ or -; got {name!r}", "tools")
        if name in out:
            raise bad_request(f"two tools are named {name!r}", "tools")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        out[name] = params
    return out


# ---- output -> tool calls -----------------------------------------------------------------------
_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_HERMES_OPEN = "<tool_call>"


def _hermes_call(text: str) -> FunctionCall | None:
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return None
    args = data.get("arguments", data.get("parameters", {}))
    return FunctionCall(name=data["name"], arguments=args if isinstance(args, str) else json.dumps(args))


def parse_tool_calls(plan: ToolPlan, text: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole output. An output the calls cannot be read from (cut short by
    max_tokens) stays content."""
    if plan.mode == "named":
        return None, [ToolCall(function=FunctionCall(name=plan.name, arguments=text))]
    if plan.mode == "required":
        try:
            items = json.loads(text)
        except json.JSONDecodeError:
            return text, []
        return None, [ToolCall(function=FunctionCall(name=c["name"], arguments=json.dumps(c["parameters"])))
                      for c in items]
    if plan.mode == "auto":
        calls = [c for c in (_hermes_call(m) for m in _HERMES.findall(text)) if c is not None]
        if not calls:
            return text, []
        content = _HERMES.sub("", text).strip()
        return content or None, [ToolCall(function=c) for c in calls]
    return text, []


@dataclass
class ToolStreamer:
    """One choice's text, as it streams, turned into content and tool-call deltas."""
    plan: ToolPlan
    text: str = ""
    sent: int = 0                   # characters of text already turned into deltas
    calls: int = 0                  # tool calls begun
    _ids: list[str] = field(default_factory=list)

    def feed(self, delta: str, finished: bool) -> tuple[str | None, list[DeltaToolCall]]:
        self.text += delta
        if self.plan.mode == "named":
            return None, self._named(delta)
        if self.plan.mode == "required":
            return None, self._required()
        if self.plan.mode == "auto":
            return self._hermes(finished)
        return delta, []

    def _start(self, name: str, arguments: str) -> DeltaToolCall:
        call = DeltaToolCall(index=self.calls, id=random_id("chatcmpl-tool"), type="function",
                             function=DeltaFunctionCall(name=name, arguments=arguments))
        self.calls += 1
        return call

    def _named(self, delta: str) -> list[DeltaToolCall]:
        if self.calls == 0:
            return [self._start(self.plan.name, delta)]
        return [DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=delta))] if delta else []

    def _required(self) -> list[DeltaToolCall]:
        """Each element of the array once it is complete."""
        out = []
        decoder = json.JSONDecoder()
        while True:
            rest = self.text[self.sent:]
            skip = len(rest) - len(rest.lstrip("[, \n\t"))
            if skip == len(rest):
                return out
            try:
                item, end = decoder.raw_decode(rest, skip)
            except json.JSONDecodeError:
                return out
            self.sent += end
            if isinstance(item, dict) and "name" in item:
                out.append(self._start(item["name"], json.dumps(item.get("parameters", {}))))

    def _hermes(self, finished: bool) -> tuple[str | None, list[DeltaToolCall]]:
        """Content up to a possible <tool_call>; each call once its </tool_call> has come."""
        content, calls = "", []
        while True:
            rest = self.text[self.sent:]
            start = rest.find(_HERMES_OPEN)
            if start < 0:
                # Hold back a tail that may be the start of <tool_call>, unless the output ended.
                keep = 0 if finished else _partial_suffix(rest, _HERMES_OPEN)
                content += rest[:len(rest) - keep]
                self.sent += len(rest) - keep
                break
            content += rest[:start]
            m = _HERMES.match(rest, start)
            if m is None:   # the call is not complete yet
                self.sent += start
                if finished:
                    content += rest[start:]
                    self.sent += len(rest) - start
                break
            call = _hermes_call(m.group(1))
            if call is not None:
                calls.append(self._start(call.name, call.arguments))
            else:
                content += m.group(0)
            self.sent += m.end()
        return content or None, calls


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of text that begins tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
