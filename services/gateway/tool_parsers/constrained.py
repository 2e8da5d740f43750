"""The reply of a request whose call was required: decoding was constrained to
a JSON array of {"name", "arguments"} objects (chat_tools.call_schema), so the
whole text is the calls. Nothing is passed on before the text is complete."""

from __future__ import annotations

import json

from services.gateway.tool_parsers.base import ParseStep, ParsedCall, ToolCallParser


class ConstrainedCallsParser(ToolCallParser):
    def __init__(self) -> None:
        self._text = ""

    def feed(self, text: str) -> ParseStep:
        self._text += text
        return ParseStep()

    def finish(self) -> ParseStep:
        text, self._text = self._text, ""
        try:
            value = json.loads(text)
        except ValueError:       # cut short (max_tokens): the text is all there is
            return ParseStep(text)
        if not isinstance(value, list) or not all(
                isinstance(item, dict) and isinstance(item.get("name"), str)
                and isinstance(item.get("arguments"), dict) for item in value):
            return ParseStep(text)
        return ParseStep(calls=[ParsedCall(item["name"], json.dumps(item["arguments"],
                                                                    ensure_ascii=False))
                                for item in value])
