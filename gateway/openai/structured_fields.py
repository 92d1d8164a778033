"""Structured outputs in an OpenAI request body: OpenAI's response_format (json_object,
json_schema), vLLM's structured_outputs {json | regex | choice | grammar | json_object} or its
older guided_* fields, at most one of them, into a StructuredOutput and the body field it came
from (what a compile error names: gateway/openai/structured.py checks that it compiles)."""

from __future__ import annotations

import json
from typing import Any

from engine_core.structured_output import StructuredOutput
from gateway.openai.validation import ValidationError

# vLLM's structured_outputs constraints -> StructuredOutput kinds (exactly one per request)
_STRUCTURED_KINDS = {"json": "json", "regex": "regex", "choice": "choice",
                     "grammar": "grammar", "json_object": "json_object"}
# vLLM's older top-level names of the same
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
           "guided_grammar": "grammar"}


def parse_structured(body: dict[str, Any]) -> tuple[StructuredOutput, str] | None:
    """The request's constraint and the field that holds it, or None."""
    found: list[tuple[str, StructuredOutput, str]] = []  # (top-level name, constraint, field)
    fmt = body.get("response_format")
    if fmt is not None:
        got = _response_format(fmt)
        if got is not None:
            found.append(("response_format", *got))
    options = body.get("structured_outputs")
    if options is not None:
        if not isinstance(options, dict):
            raise ValidationError("structured_outputs", "structured_outputs must be an object, "
                                  f"got {options!r:.100}")
        given = [k for k in _STRUCTURED_KINDS if options.get(k) not in (None, False)]
        if len(given) != 1:
            raise ValidationError("structured_outputs", "structured_outputs must set exactly "
                                  f"one of {', '.join(_STRUCTURED_KINDS)}, got "
                                  f"{', '.join(given) or 'none'}")
        field = f"structured_outputs.{given[0]}"
        found.append(("structured_outputs", _constraint(
            _STRUCTURED_KINDS[given[0]], options[given[0]], field), field))
    for name, kind in _GUIDED.items():
        if body.get(name) is not None:
            found.append((name, _constraint(kind, body[name], name), name))
    if len(found) > 1:
        raise ValidationError(found[1][0], f"{found[0][0]} and {found[1][0]} both constrain "
                              "the output: send one of them")
    return found[0][1:] if found else None


def _response_format(fmt: Any) -> tuple[StructuredOutput, str] | None:
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object"), "response_format"
    if kind == "json_schema":
        field = "response_format.json_schema.schema"
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise ValidationError(field, f"{field} must be a JSON schema object, got "
                                  f"{spec!r:.100}")
        return _constraint("json", spec["schema"], field), field
    raise ValidationError("response_format", "response_format.type must be text, json_object "
                          f"or json_schema, got {fmt!r:.100}")


def _constraint(kind: str, value: Any, field: str) -> StructuredOutput:
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise ValidationError(field, f"{field} must be a JSON schema, got text that "
                                      f"is not JSON: {value!r:.100}") from None
        if not isinstance(value, (dict, bool)):
            raise ValidationError(field, f"{field} must be a JSON schema object, got "
                                  f"{value!r:.100}")
        value = json.dumps(value)  # key order kept: it is the order the output follows
    elif kind == "choice":
        if (not isinstance(value, list) or not value
                or not all(isinstance(c, str) for c in value)):
            raise ValidationError(field, f"{field} must be a non-empty list of strings, got "
                                  f"{value!r:.100}")
        value = json.dumps(value)
    elif kind == "json_object":
        value = ""
    elif not isinstance(value, str) or not value:
        raise ValidationError(field, f"{field} must be a non-empty string, got {value!r:.100}")
    try:
        return StructuredOutput(kind, value)
    except ValueError as e:
        raise ValidationError(field, f"{field}: {e}") from None
