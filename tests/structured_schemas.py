"""JSON schemas for the structured-output tests: nested objects, arrays with bounds, enums,
patterns, optional and nullable fields, $ref, anyOf/oneOf. Strings are bounded (maxLength,
pattern or enum) and objects closed (additionalProperties: false) so that every output ends
well within the tests' max_tokens: a constrained output is valid unless it is cut."""

from __future__ import annotations

from typing import Any


def _obj(props: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {"type": "object", "properties": props,
            "required": list(props) if required is None else required,
            "additionalProperties": False}


NAME = {"type": "string", "maxLength": 12}
SMALL_INT = {"type": "integer", "minimum": 0, "maximum": 99}

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": _obj({"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    "enum_color": _obj({"color": {"enum": ["red", "green", "blue"]}}),
    "bool_and_optional": _obj({"done": {"type": "boolean"}, "note": NAME}, ["done"]),
    "int_array_2_4": _obj({"values": {"type": "array", "items": SMALL_INT,
                                      "minItems": 2, "maxItems": 4}}),
    "enum_array_1_3": _obj({"tags": {"type": "array", "minItems": 1, "maxItems": 3,
                                     "items": {"enum": ["a", "b", "c", "d"]}}}),
    "nested_address": _obj({"name": NAME, "address": _obj({
        "street": NAME, "city": NAME,
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})}),
    "phone_pattern": _obj({"phone": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"}}),
    "date_pattern": _obj({"date": {"type": "string",
                                   "pattern": "^20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])$"}}),
    "optional_fields": _obj({"title": NAME, "subtitle": NAME, "pages": SMALL_INT}, ["title"]),
    "array_of_objects": _obj({"items": {"type": "array", "minItems": 1, "maxItems": 3,
                                        "items": _obj({"id": SMALL_INT,
                                                       "kind": {"enum": ["x", "y"]}})}}),
    "const_fields": _obj({"version": {"const": 2}, "ok": {"const": True}}),
    "bounded_number": _obj({"price": {"type": "number", "minimum": 0, "maximum": 1000}}),
    "any_of": _obj({"value": {"anyOf": [SMALL_INT, {"type": "string", "maxLength": 6}]}}),
    "matrix": _obj({"rows": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
        "type": "array", "minItems": 2, "maxItems": 2,
        "items": {"type": "integer", "minimum": 0, "maximum": 9}}}}),
    "top_level_array": {"type": "array", "minItems": 2, "maxItems": 2,
                        "items": {"enum": ["left", "right"]}},
    "top_level_enum": {"enum": ["yes", "no", "maybe"]},
    "top_level_integer": {"type": "integer", "minimum": 1, "maximum": 10},
    "email_pattern": _obj({"email": {"type": "string",
                                     "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.(com|org)$"}}),
    "deep_nesting": _obj({"a": _obj({"b": _obj({"c": _obj({"d": {"type": "boolean"}})})})}),
    "nullable": _obj({"nickname": {"type": ["string", "null"], "maxLength": 10},
                      "score": SMALL_INT}),
    "one_of_shapes": _obj({"shape": {"oneOf": [
        _obj({"kind": {"const": "circle"}, "radius": SMALL_INT}),
        _obj({"kind": {"const": "square"}, "side": SMALL_INT})]}}),
    "refs": {"$defs": {"point": _obj({"x": SMALL_INT, "y": SMALL_INT})},
             **_obj({"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}})},
    "product": _obj({
        "name": NAME, "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
        "in_stock": {"type": "boolean"},
        "tags": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 8}},
        "rating": {"enum": [1, 2, 3, 4, 5]}}, ["name", "sku", "in_stock"]),
}

MAX_TOKENS = 160  # far more than the longest output the schemas allow needs


def prompt_for(name: str, schema: dict[str, Any]) -> list[dict[str, str]]:
    """A chat asking for the schema's JSON (the constraint guarantees it; the words help the
    small model pick plausible values)."""
    return [{"role": "user", "content": f"Write a JSON value for a '{name.replace('_', ' ')}'"
             " and nothing else."}]


# tool calling: two tools with closed, bounded arguments
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 16},
    "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"],
    "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather",
                                           "description": "Current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time",
                                           "description": "Current time in a zone",
                                           "parameters": TIME}}]
TOOL_SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris and the time in Berlin?"}]
