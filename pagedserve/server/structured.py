"""The request fields that constrain the output, turned into one StructuredOutputsParams.

OpenAI's `response_format` (json_object, json_schema, text), vLLM's `structured_outputs`
(json, regex, choice, grammar, json_object) and its older `guided_json`, `guided_regex`,
`guided_choice`, `guided_grammar`. At most one of them may constrain a request. A bad
constraint is a 400 naming the field the client used; it never reaches the engine.
"""
from __future__ import annotations

from typing import Any

from pagedserve.errors import InvalidRequestError
from pagedserve.server.errors import bad_request
from pagedserve.server.protocol import SamplingRequest
from pagedserve.structured.params import KINDS, StructuredOutputsParams

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def requested_constraint(body: SamplingRequest) -> tuple[str, dict[str, Any]] | None:
    """(the field that asks for it, StructuredOutputsParams' arguments), or None."""
    found: list[tuple[str, dict[str, Any]]] = []
    rf = body.response_format
    if rf is not None:
        kind = rf.get("type")
        if kind == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif kind == "json_schema":
            spec = rf.get("json_schema")
            if not isinstance(spec, dict) or "schema" not in spec:
                raise bad_request("response_format json_schema needs json_schema.schema", "response_format")
            found.append(("response_format", {"json": spec["schema"]}))
        elif kind != "text":
            raise bad_request(f"response_format type must be text, json_object or json_schema; got {kind!r}",
                              "response_format")
    if body.structured_outputs is not None:
        so = dict(body.structured_outputs)
        so.pop("disable_any_whitespace", None)   # vLLM's; JSON is compact here unless any_whitespace
        unknown = sorted(set(so) - {*KINDS, "any_whitespace"})
        if unknown:
            raise bad_request(f"structured_outputs: unsupported fields {unknown}; supported: "
                              f"{', '.join(KINDS)}, any_whitespace", "structured_outputs")
        found.append(("structured_outputs", so))
    for field, kind in GUIDED.items():
        value = getattr(body, field)
        if value is not None:
            found.append((field, {kind: value}))
    if len(found) > 1:
        raise bad_request(f"give one of response_format, structured_outputs and guided_*; got "
                          f"{', '.join(f for f, _ in found)}", found[1][0])
    return found[0] if found else None


def build_constraint(field: str, kwargs: dict[str, Any]) -> StructuredOutputsParams:
    """Parse the constraint (a schema, regex or grammar: call it off the event loop)."""
    try:
        return StructuredOutputsParams(**kwargs)
    except InvalidRequestError as e:
        raise bad_request(e.message, field) from None
    except TypeError as e:
        raise bad_request(f"invalid {field}: {e}", field) from None
