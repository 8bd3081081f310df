"""A tool's `parameters` must be a JSON Schema (draft 2020-12's vocabulary, the part tool schemas use): a malformed one is a
400 naming where it is wrong, whatever the tool choice, rather than a prompt the model cannot read or a grammar that fails
later. Checked here: every schema is an object or a boolean; `type` is one of the seven JSON types or a list of them (the
top level, when it has a type, is `object`); `properties`, `$defs` and `definitions` map names to schemas; `items`,
`additionalProperties`, `not` and the like are schemas; `anyOf` / `oneOf` / `allOf` / `prefixItems` are lists of schemas;
`required` is a list of strings and `enum` a list. Other keywords (formats, bounds, descriptions) are left to the grammar."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from openk3.api.errors import APIError
from openk3.api.protocol import Tool

JSON_TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})
_SCHEMA = ("items", "additionalProperties", "not", "contains", "propertyNames", "if", "then", "else", "unevaluatedProperties", "additionalItems")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")


def check_tool_schemas(tools: Iterable[Tool]) -> None:
    """APIError(400) naming the first tool whose `parameters` is not a JSON Schema, and where in it."""
    for i, tool in enumerate(tools):
        params = tool.function.parameters
        if params is None:
            continue
        where = f"tools[{i}].function.parameters"
        problem = _problem(params, where)
        if problem is None and "type" in params and params["type"] != "object":
            problem = f"{where}.type is {params['type']!r}: a tool's parameters are an object"
        if problem is not None:
            raise APIError(400, f"{problem} (not a valid JSON Schema)", param="tools", code="invalid_value")


def _problem(schema: Any, where: str) -> str | None:
    if isinstance(schema, bool):
        return None
    if not isinstance(schema, dict):
        return f"{where} is {type(schema).__name__}: a schema is an object or a boolean"
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    if kind is not None and (not kinds or not all(isinstance(k, str) and k in JSON_TYPES for k in kinds)):
        return f"{where}.type is {kind!r}: expected one of {', '.join(sorted(JSON_TYPES))}, or a list of them"
    required = schema.get("required")
    if required is not None and not (isinstance(required, list) and all(isinstance(r, str) for r in required)):
        return f"{where}.required is {required!r}: expected a list of property names"
    if "enum" in schema and not isinstance(schema["enum"], list):
        return f"{where}.enum is {schema['enum']!r}: expected a list"
    return _nested_problem(schema, where)


def _nested_problem(schema: dict[str, Any], where: str) -> str | None:
    for key in _SCHEMA:
        if key in schema and not (key == "items" and isinstance(schema[key], list)):
            if (p := _problem(schema[key], f"{where}.{key}")) is not None:
                return p
    for key in _SCHEMA_LISTS + (("items",) if isinstance(schema.get("items"), list) else ()):
        if key in schema:
            if not isinstance(schema[key], list):
                return f"{where}.{key} is {type(schema[key]).__name__}: expected a list of schemas"
            for j, sub in enumerate(schema[key]):
                if (p := _problem(sub, f"{where}.{key}[{j}]")) is not None:
                    return p
    for key in _SCHEMA_MAPS:
        if key in schema:
            if not isinstance(schema[key], dict):
                return f"{where}.{key} is {type(schema[key]).__name__}: expected an object of schemas"
            for name, sub in schema[key].items():
                if (p := _problem(sub, f"{where}.{key}.{name}")) is not None:
                    return p
    return None
