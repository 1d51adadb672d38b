"""Grammars the tests share: JSON schemas of the kinds users send, and the hostile chains of issue 63 (imported as a
module: tests/ is on sys.path under pytest)."""

from __future__ import annotations

from typing import Any

SCHEMAS: dict[str, dict[str, Any]] = {
    "flat_minimum": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                                      "age": {"type": "integer", "minimum": 18}},
                     "required": ["name", "age"], "additionalProperties": False},
    "enum_array": {"type": "object", "properties": {"colors": {
        "type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 2, "maxItems": 3}},
        "required": ["colors"], "additionalProperties": False},
    "nested_lengths": {"type": "object", "properties": {"user": {
        "type": "object", "properties": {"first": {"type": "string", "minLength": 2, "maxLength": 12},
                                         "address": {"type": "object", "properties": {
                                             "city": {"type": "string", "minLength": 1, "maxLength": 16}},
                                             "required": ["city"], "additionalProperties": False}},
        "required": ["first", "address"], "additionalProperties": False}},
        "required": ["user"], "additionalProperties": False},
    "pattern_unit": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                                                      "score": {"type": "number", "minimum": 0, "maximum": 1}},
                     "required": ["code", "score"], "additionalProperties": False},
}


def defs_chain(n: int) -> dict[str, Any]:
    """Row 2: n `$defs`, each an array whose items are the next."""
    defs: dict[str, Any] = {f"d{i}": {"type": "array", "items": {"$ref": f"#/$defs/d{i + 1}"}} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def alias_chain(n: int) -> dict[str, Any]:
    defs: dict[str, Any] = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def lark_chain(n: int) -> str:
    """Row 1: n rules `r{i}: r{i+1} "a" | "b"`."""
    return "\n".join(["start: r0", *(f'r{i}: r{i + 1} "a" | "b"' for i in range(n)), f'r{n}: "c"'])


def nested(n: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(n):
        schema = {"type": "array", "items": schema}
    return schema
