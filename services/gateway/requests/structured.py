"""Structured output as the clients ask for it: OpenAI's `response_format`, vLLM's `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar` and its newer `structured_outputs` object, read
into the one Constraint the request carries (common/types.py). At most one of them may ask for
something; a shape this server does not take, or one past the size limits the worker has too
(common/grammar.py), is a 400 naming the field. Whether the schema, regex or grammar itself
compiles is build_spec's check (common/grammar.py), before queueing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from common.grammar import ConstraintError, check_size, json_schema_constraint
from common.types import Constraint, ConstraintKind
from services.gateway.errors import bad_request

# structured_outputs' keys that ask for a constraint; the flags after them ask for nothing more
# than this server does anyway (compact JSON, one engine with no fallback).
_STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")
_STRUCTURED_NO_OPS = {"disable_any_whitespace": (True, False), "disable_fallback": (True, False),
                      "disable_additional_properties": (False,)}


@dataclass(frozen=True)
class ConstraintFields:
    """The structured-output fields of a body, as the client sent them."""
    response_format: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None


def body_constraint(body: Any) -> dict[str, Any]:
    """RequestFields' constraint and constraint_param of a request body (schemas.py's fields)."""
    constraint, param = read_constraint(ConstraintFields(
        response_format=body.response_format, guided_json=body.guided_json, guided_regex=body.guided_regex,
        guided_choice=body.guided_choice, guided_grammar=body.guided_grammar,
        structured_outputs=body.structured_outputs))
    return {"constraint": constraint, "constraint_param": param} if constraint is not None else {}


def read_constraint(fields: ConstraintFields) -> tuple[Constraint | None, str]:
    """(the constraint, the field that asked for it) or (None, "") when none does."""
    found: list[tuple[Constraint, str]] = []
    readers = (("response_format", _response_format), ("guided_json", _guided_json),
               ("guided_regex", _text_constraint(ConstraintKind.REGEX)), ("guided_choice", _choices),
               ("guided_grammar", _text_constraint(ConstraintKind.GRAMMAR)),
               ("structured_outputs", _structured_outputs))
    for name, read in readers:
        value = getattr(fields, name)
        if value is None:
            continue
        constraint = read(value, name)
        if constraint is None:
            continue
        try:
            check_size(constraint)
        except ConstraintError as error:
            raise bad_request(f"{name}: {error}.", name, "constraint_too_large") from None
        if found:
            raise bad_request(f"{name} and {found[0][1]} both constrain the output; send one of them.",
                              name, "conflicting_constraints")
        found.append((constraint, name))
    return found[0] if found else (None, "")


def _response_format(value: Any, param: str) -> Constraint | None:
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise bad_request("response_format must be an object with a type.", param)
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint(ConstraintKind.JSON_OBJECT)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise bad_request("response_format.json_schema must be an object with a schema.",
                              f"{param}.json_schema")
        schema = spec.get("schema", spec.get("json_schema"))
        if not isinstance(schema, dict):
            raise bad_request("response_format.json_schema.schema must be a JSON schema object.",
                              f"{param}.json_schema.schema")
        return json_schema_constraint(schema)
    raise bad_request(f"response_format type {kind!r} is not supported; use text, json_object or "
                      "json_schema.", f"{param}.type", "unsupported_parameter")


def _guided_json(value: Any, param: str) -> Constraint:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as error:
            raise bad_request(f"{param} is not valid JSON: {error}", param) from None
    if not isinstance(value, dict):
        raise bad_request(f"{param} must be a JSON schema object.", param)
    return json_schema_constraint(value)


def _text_constraint(kind: ConstraintKind):
    def read(value: Any, param: str) -> Constraint:
        if not isinstance(value, str) or not value:
            raise bad_request(f"{param} must be a non-empty string.", param)
        return Constraint(kind, value)
    return read


def _choices(value: Any, param: str) -> Constraint:
    if (not isinstance(value, list) or not value
            or not all(isinstance(choice, str) and choice for choice in value)):
        raise bad_request(f"{param} must be a non-empty list of non-empty strings.", param)
    return Constraint(ConstraintKind.CHOICE, choices=tuple(dict.fromkeys(value)))


def _structured_outputs(value: Any, param: str) -> Constraint | None:
    if not isinstance(value, dict):
        raise bad_request(f"{param} must be an object.", param)
    for key, item in value.items():
        if item is None or key in _STRUCTURED_KINDS:
            continue
        if key not in _STRUCTURED_NO_OPS or item not in _STRUCTURED_NO_OPS[key]:
            raise bad_request(f"{param}.{key} is not supported by this server.", f"{param}.{key}",
                              "unsupported_parameter")
    asked = [key for key in _STRUCTURED_KINDS if value.get(key) not in (None, False)]
    if len(asked) > 1:
        raise bad_request(f"{param} sets {' and '.join(asked)}; set one of them.", param,
                          "conflicting_constraints")
    if not asked:
        return None
    key = asked[0]
    name = f"{param}.{key}"
    if key == "json_object":
        return Constraint(ConstraintKind.JSON_OBJECT)
    if key == "json":
        return _guided_json(value[key], name)
    if key == "choice":
        return _choices(value[key], name)
    return _text_constraint(ConstraintKind.REGEX if key == "regex" else ConstraintKind.GRAMMAR)(value[key], name)
