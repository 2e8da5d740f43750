"""The reply of a request whose call was required: decoding was constrained to
a JSON array of {"name", "arguments"} objects (chat_tools.call_schema), so the
whole text is the calls. A reply cut short (max_tokens) keeps the calls it
completed (streamed, what of the last one came)."""

from __future__ import annotations

import json
import re
from typing import Any

from services.gateway.tool_parsers.base import ParseStep, ParsedCall, ToolCallParser

_DECODER = json.JSONDecoder()
# The start of the next call in a constrained array: "[" or the previous call's "}" and ",".
ITEM_HEAD = re.compile(r'\s*(?:\}\s*)?[\[,]\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"arguments"\s*:\s*(?=\{)')
MAX_HEAD = 128
_BLANKS = " \t\n\r"


def _is_call(item: Any) -> bool:
    return (isinstance(item, dict) and isinstance(item.get("name"), str)
            and isinstance(item.get("arguments"), dict))


def complete_items(text: str) -> list[Any]:
    """The whole elements at the start of a JSON array's text, however it ends."""
    position = len(text) - len(text.lstrip(_BLANKS))
    if not text.startswith("[", position):
        return []
    position += 1
    items: list[Any] = []
    while True:
        while position < len(text) and text[position] in _BLANKS:
            position += 1
        try:
            item, position = _DECODER.raw_decode(text, position)
        except ValueError:
            return items
        items.append(item)
        while position < len(text) and text[position] in _BLANKS:
            position += 1
        if not text.startswith(",", position):
            return items
        position += 1


class ConstrainedCallsParser(ToolCallParser):
    """With `incremental`, each call is passed on as the array grows: its name
    once {"name": ..., "arguments": is written, then its arguments' text up to
    the brace that closes them (the grammar writes the keys in the schema's
    order, name first). Text in any other shape is read whole at the end."""

    def __init__(self, incremental: bool = False) -> None:
        super().__init__(incremental)
        self._text = ""
        self._scan = 0                   # where the next call's head may start
        self._arguments: _Scan | None = None
        self._streamed = False           # some call went out in pieces: no whole reading after
        self._stalled = False            # the text is not in the streamed shape

    def feed(self, text: str) -> ParseStep:
        self._text += text
        step = ParseStep()
        while self.incremental and not self._stalled:
            if self._arguments is None and not self._open_call(step):
                break
            assert self._arguments is not None
            fragment, done = self._arguments.advance(self._text)
            if fragment:
                step.calls.append(ParsedCall(None, fragment))
            if not done:
                break
            self._scan, self._arguments = self._arguments.position, None
        return step

    def _open_call(self, step: ParseStep) -> bool:
        head = ITEM_HEAD.match(self._text, self._scan)
        if head is None:
            # A head is short (names are at most 64 characters): past that, another shape.
            self._stalled = len(self._text) - self._scan > MAX_HEAD
            return False
        self._streamed = True
        step.calls.append(ParsedCall(head.group(1), ""))
        self._arguments = _Scan(head.end())
        return True

    def finish(self) -> ParseStep:
        text, self._text = self._text, ""
        if self._streamed:          # its calls went out as they came
            return ParseStep()
        try:
            value = json.loads(text)
        except ValueError:
            value = complete_items(text)
        if not isinstance(value, list) or not value or not all(_is_call(item) for item in value):
            return ParseStep(text)
        # Compact, as the grammar wrote them (and as they stream).
        return ParseStep(calls=[ParsedCall(item["name"], json.dumps(
            item["arguments"], ensure_ascii=False, separators=(",", ":"))) for item in value])


class _Scan:
    """A JSON value's text read as it grows: depth and strings tracked, so its
    end is known at its closing brace."""

    def __init__(self, start: int) -> None:
        self.position = start
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def advance(self, text: str) -> tuple[str, bool]:
        """(the value's text since the last call, whether it is now whole)."""
        start, position, done = self.position, self.position, False
        while position < len(text) and not done:
            char = text[position]
            position += 1
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                done = self._depth == 0
        self.position = position
        return text[start:position], done
