"""The reply of a request whose call was required: decoding was constrained to
a JSON array of {"name", "arguments"} objects (chat_tools.call_schema), so the
whole text is the calls. Nothing is passed on before the text is complete. A
reply cut short (max_tokens) keeps the calls it completed."""

from __future__ import annotations

import json
from typing import Any

from services.gateway.tool_parsers.base import ParseStep, ParsedCall, ToolCallParser

_DECODER = json.JSONDecoder()
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
    def __init__(self, incremental: bool = False) -> None:
        super().__init__(incremental)   # the calls are known only once the array is whole
        self._text = ""

    def feed(self, text: str) -> ParseStep:
        self._text += text
        return ParseStep()

    def finish(self) -> ParseStep:
        text, self._text = self._text, ""
        try:
            value = json.loads(text)
        except ValueError:
            value = complete_items(text)
        if not isinstance(value, list) or not value or not all(_is_call(item) for item in value):
            return ParseStep(text)
        return ParseStep(calls=[ParsedCall(item["name"], json.dumps(item["arguments"],
                                                                    ensure_ascii=False))
                                for item in value])
