"""A structured-output Constraint as the grammar engine's grammar, and its check.

The engine is llguidance (chosen by measurement, docs/engine/structured-output.md): it imports without torch, so
the gateway checks every constraint with it before a request is queued, and the worker builds
its matchers from the same grammar text. JSON comes out compact (no free whitespace between
tokens, `,` and `:` as separators), so a constrained output cannot spend its budget on blanks.
A GBNF/EBNF grammar (rules written `name ::= ...`, as llama.cpp and xgrammar take them) is
translated to Lark first.

Size limits, shared by the gateway (which refuses past them with a 400 naming the field, before
anything is compiled) and the worker (whose matchers are built with the same parser limits):
the worker's Earley parser holds at most MAX_ITEMS_IN_ROW items in a row, and a choice row holds
one item per choice plus one, so MAX_CHOICES choices; the text of a regex, schema or grammar
(and the choices together) at most MAX_CONSTRAINT_CHARS characters.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from common.types import Constraint, ConstraintKind

# Compact JSON: what json.dumps(separators=(",", ":")) writes.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
MAX_ITEMS_IN_ROW = 2000          # llguidance's ParserLimits.max_items_in_row (its default)
MAX_CHOICES = MAX_ITEMS_IN_ROW - 1
MAX_CONSTRAINT_CHARS = 64 * 1024


class ConstraintError(ValueError):
    """The constraint cannot be compiled; the message says why."""


def json_schema_constraint(schema: Any) -> Constraint:
    """The Constraint for a JSON Schema given as a parsed value (a dict) or as JSON text. Key order
    is kept: the output's properties come in the schema's order."""
    text = schema if isinstance(schema, str) else json.dumps(schema, separators=(",", ":"))
    return Constraint(ConstraintKind.JSON_SCHEMA, text)


def parser_limits() -> Any:
    """The llguidance ParserLimits every matcher and check is built with."""
    from llguidance import LLParserLimits

    return LLParserLimits(max_items_in_row=MAX_ITEMS_IN_ROW)


def check_size(constraint: Constraint) -> None:
    """Raises ConstraintError when `constraint` is past the size limits (cheap: nothing compiled)."""
    if constraint.kind is ConstraintKind.CHOICE:
        if len(constraint.choices) > MAX_CHOICES:
            raise ConstraintError(f"at most {MAX_CHOICES} choices, got {len(constraint.choices)}")
        chars = sum(len(choice) for choice in constraint.choices)
    else:
        chars = len(constraint.value)
    if chars > MAX_CONSTRAINT_CHARS:
        raise ConstraintError(f"at most {MAX_CONSTRAINT_CHARS} characters, got {chars}")


def grammar_of(constraint: Constraint) -> str:
    """The llguidance grammar of `constraint` (not yet checked: see check)."""
    from llguidance import LLMatcher

    kind = constraint.kind
    if kind is ConstraintKind.JSON_OBJECT:
        return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if kind is ConstraintKind.JSON_SCHEMA:
        try:
            schema = json.loads(constraint.value)
        except ValueError as error:
            raise ConstraintError(f"the schema is not valid JSON: {error}") from None
        if not isinstance(schema, (dict, bool)):
            raise ConstraintError("the schema must be a JSON object")
        try:
            return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        except (ValueError, TypeError) as error:
            raise ConstraintError(str(error)) from None
    if kind is ConstraintKind.REGEX:
        return LLMatcher.grammar_from_regex(constraint.value)
    if kind is ConstraintKind.CHOICE:
        if not constraint.choices:
            raise ConstraintError("the choices are empty")
        # Lark string literals: JSON's escapes are Lark's.
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in constraint.choices))
    if kind is ConstraintKind.GRAMMAR:
        return LLMatcher.grammar_from_lark(_lark_text(constraint.value))
    raise ConstraintError(f"unknown constraint kind {kind!r}")


@functools.lru_cache(maxsize=256)
def check(constraint: Constraint) -> str:
    """The grammar of `constraint`, checked (the last ones remembered: n > 1 choices and a schema
    sent again are checked once); raises ConstraintError naming the problem."""
    from llguidance import LLMatcher

    check_size(constraint)
    # A panic is the library failing on this text itself (its own bug, e.g. cutting an error
    # message inside a 4-byte character): the request's problem all the same, never the server's.
    with panics_as(lambda _: ConstraintError("the grammar library could not read this constraint")):
        grammar = grammar_of(constraint)
        error = LLMatcher.validate_grammar(grammar, limits=parser_limits())
    if error:
        raise ConstraintError(error.strip())
    return grammar


def is_library_panic(failure: BaseException) -> bool:
    """Whether `failure` is a panic of llguidance's Rust code: pyo3 raises it as a
    PanicException, which derives from BaseException (no `except Exception` catches it)."""
    return type(failure).__name__ == "PanicException"


@contextmanager
def panics_as(error: Callable[[BaseException], Exception]) -> Iterator[None]:
    """Runs the block with a library panic raised again as `error(panic)`, an Exception that the
    code around it handles (the gateway's 400s, the worker's step isolation)."""
    try:
        yield
    except BaseException as failure:
        if not is_library_panic(failure):
            raise
        raise error(failure) from None


def panic_error(what: str) -> Callable[[BaseException], Exception]:
    """For `panics_as`: a RuntimeError naming `what` and the panic's message."""
    return lambda failure: RuntimeError(f"the grammar library failed on {what}: {str(failure)[:200]}")


def _lark_text(text: str) -> str:
    if "::=" not in text:
        return text
    from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark

    try:
        return gbnf_to_lark(text)
    except GbnfToLarkError as error:
        raise ConstraintError(f"the GBNF grammar does not parse: {error}") from None
