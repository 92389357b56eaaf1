"""StructuredOutputsParams: what a request's output must match (vLLM's shape), checked when built.

Exactly one constraint: `json` (a JSON schema, as a dict or its text), `regex`, `choice` (one of
these strings), `grammar` (EBNF, xgrammar's dialect of GBNF) or `json_object` (any JSON object).
Building one parses the constraint (jsonschema checks a schema against its meta-schema, then
xgrammar converts it; a regex or grammar is parsed by xgrammar), so a bad one is refused with an
InvalidRequestError naming the field before the request reaches the engine. Compiling it against
the vocabulary happens later, off the engine thread (structured/compiler.py).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from pagedserve.errors import InvalidRequestError

KINDS = ("json", "regex", "choice", "grammar", "json_object")

# Limits checked when the params are built (cheap, linear in the constraint's size), so that no
# conversion or compile runs long. JSON nesting (objects and arrays) of a schema: deeper ones
# would hit Python's recursion limit in the validators and xgrammar. The sum of the bounds of
# a constraint's bounded repeats (x{m,n} in a regex or a schema's patterns): xgrammar's
# conversion of a schema's pattern is quadratic (or worse) in them.
MAX_SCHEMA_DEPTH = 64
MAX_REPEAT = 1000
_REPEAT = re.compile(r"(?<!\\)\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


@dataclass
class StructuredOutputsParams:
    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # Let the model put any whitespace between JSON tokens (vLLM's default). Off here: JSON comes in
    # one compact layout, so a small model at a high temperature cannot ramble in whitespace.
    any_whitespace: bool = False
    _key: tuple[str, str] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError(
                f"structured outputs need exactly one of {', '.join(KINDS)}; got "
                f"{', '.join(given) or 'none'}", "structured_outputs")
        kind = self.kind
        if kind == "json":
            self.json = _parse_schema(self.json)
        elif kind == "choice":
            if not isinstance(self.choice, list) or not self.choice or \
                    not all(isinstance(c, str) and c for c in self.choice):
                raise InvalidRequestError("choice must be a non-empty list of non-empty strings",
                                          "structured_outputs.choice")
        elif kind in ("regex", "grammar"):
            text = getattr(self, kind)
            if not isinstance(text, str) or not text:
                raise InvalidRequestError(f"{kind} must be a non-empty string", f"structured_outputs.{kind}")
            if kind == "regex":
                _check_repeats([text], "structured_outputs.regex")
        elif self.json_object is not True:
            raise InvalidRequestError("json_object must be true", "structured_outputs.json_object")
        if kind in ("regex", "grammar", "choice"):
            self.grammar_text()   # parse it now (linear, fast): a bad regex or grammar is the caller's error
        # A schema is converted to a grammar on the compile pool (structured/manager.py): the
        # conversion's cost grows with the schema, and xgrammar's errors then fail the request.
        self._key = self._make_key()

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[str, str]:
        """What the compiled grammar is cached by (computed when built: its size is the
        constraint's, so the engine thread never does it)."""
        if self._key is None:
            self._key = self._make_key()
        return self._key

    def _make_key(self) -> tuple[str, str]:
        kind = self.kind
        if kind == "json":
            return (f"json/{self.any_whitespace}", json.dumps(self.json, sort_keys=True))
        if kind == "choice":
            return ("choice", json.dumps(self.choice))
        if kind == "json_object":
            return (f"json_object/{self.any_whitespace}", "")
        return (kind, getattr(self, kind))

    def grammar_text(self) -> str:
        """The constraint as an xgrammar EBNF grammar (parsing it: InvalidRequestError if bad)."""
        import xgrammar as xgr
        kind = self.kind
        param = f"structured_outputs.{kind}"
        try:
            if kind == "json":
                grammar = xgr.Grammar.from_json_schema(json.dumps(self.json), **self._json_layout())
            elif kind == "json_object":
                grammar = xgr.Grammar.from_json_schema('{"type": "object"}', **self._json_layout())
            elif kind == "regex":
                grammar = xgr.Grammar.from_regex(self.regex)
            elif kind == "choice":
                grammar = xgr.Grammar.from_ebnf("root ::= " + " | ".join(_ebnf_string(c) for c in self.choice))
            else:
                grammar = xgr.Grammar.from_ebnf(self.grammar)
        except (RuntimeError, ValueError, TypeError) as e:
            raise InvalidRequestError(f"invalid {kind}: {_first_line(e)}", param) from None
        return str(grammar)

    def _json_layout(self) -> dict[str, Any]:
        if self.any_whitespace:
            return {"any_whitespace": True}
        return {"any_whitespace": False, "separators": (", ", ": ")}


def _parse_schema(schema: Any) -> dict:
    param = "structured_outputs.json"
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise InvalidRequestError(f"the JSON schema is not valid JSON: {e}", param) from None
        except RecursionError:
            raise _too_deep(param) from None
    if isinstance(schema, bool):
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"a JSON schema must be an object, got {type(schema).__name__}", param)
    _check_repeats(_schema_patterns(schema, param), param)
    import jsonschema
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.path)
        raise InvalidRequestError(f"invalid JSON schema{' at ' + where if where else ''}: {e.message}",
                                  param) from None
    return schema


def _too_deep(param: str) -> InvalidRequestError:
    return InvalidRequestError(f"the JSON schema is nested too deep: at most {MAX_SCHEMA_DEPTH} levels of objects "
                               f"and arrays", param)


def _schema_patterns(schema: dict, param: str) -> list[str]:
    """The regexes of a schema (each `pattern`, each key of `patternProperties`), walking it
    without recursion; InvalidRequestError if it nests deeper than MAX_SCHEMA_DEPTH."""
    patterns: list[str] = []
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            raise _too_deep(param)
        if isinstance(node, dict):
            if isinstance(node.get("pattern"), str):
                patterns.append(node["pattern"])
            if isinstance(node.get("patternProperties"), dict):
                patterns.extend(k for k in node["patternProperties"] if isinstance(k, str))
            stack.extend((v, depth + 1) for v in node.values() if isinstance(v, (dict, list)))
        else:
            stack.extend((v, depth + 1) for v in node if isinstance(v, (dict, list)))
    return patterns


def _check_repeats(regexes: list[str], param: str) -> None:
    """The bounds of the bounded repeats of a constraint's regexes sum to at most MAX_REPEAT."""
    total = 0
    for regex in regexes:
        for m in _REPEAT.finditer(regex):
            low, high = m.group(1), m.group(2)
            total += max(int(low), int(high) if high else 0)
            if total > MAX_REPEAT:
                raise InvalidRequestError(
                    f"the constraint's bounded repeats are too large: their bounds ({m.group(0)} and the others) "
                    f"sum to more than {MAX_REPEAT}; use an unbounded repeat (* or +) with max_tokens instead",
                    param)


def _ebnf_string(text: str) -> str:
    """A string literal of xgrammar's EBNF (JSON's escapes are a subset of what it reads)."""
    return json.dumps(text, ensure_ascii=False)


def _first_line(e: Exception) -> str:
    """xgrammar's message without its log prefix ("[12:00:00] /path/file.cc:94: ")."""
    lines = [line for line in str(e).strip().splitlines() if line.strip()]
    return re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", lines[0]) if lines else type(e).__name__
