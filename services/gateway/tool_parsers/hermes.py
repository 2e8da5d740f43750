"""The Hermes / Qwen convention: each call is a JSON object
{"name": ..., "arguments": {...}} between <tool_call> and </tool_call>, with
any content before, between or after the calls."""

from __future__ import annotations

import json
from typing import Any

from services.gateway.tool_parsers.base import ParseStep, ParsedCall, ToolCallParser

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that could begin `tag`."""
    for length in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0


def parse_call(body: str) -> ParsedCall | None:
    """A tag's JSON as a call, or None when it is not one ("parameters" is a
    name some models use for the arguments)."""
    try:
        value: Any = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):   # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False))


class HermesToolParser(ToolCallParser):
    def __init__(self) -> None:
        self._pending = ""        # text not yet passed on
        self._in_call = False
        self._calls = 0

    def feed(self, text: str) -> ParseStep:
        self._pending += text
        step = ParseStep()
        while True:
            tag = CLOSE_TAG if self._in_call else OPEN_TAG
            at = self._pending.find(tag)
            if at < 0:
                break
            before, self._pending = self._pending[:at], self._pending[at + len(tag):]
            if self._in_call:
                step = step.then(self._close(before))
            else:
                step.content += self._content(before)
            self._in_call = not self._in_call
        if not self._in_call:
            keep = _held_prefix(self._pending, OPEN_TAG)
            step.content += self._content(self._pending[:len(self._pending) - keep])
            self._pending = self._pending[len(self._pending) - keep:]
        return step

    def finish(self) -> ParseStep:
        pending, self._pending = self._pending, ""
        if self._in_call:   # the reply ended inside a call (its end of turn cut the tag)
            self._in_call = False
            return self._close(pending)
        return ParseStep(self._content(pending))

    def _close(self, body: str) -> ParseStep:
        call = parse_call(body.strip())
        if call is None:   # not a call after all: the text stays content, tags and all
            return ParseStep(self._content(f"{OPEN_TAG}{body}{CLOSE_TAG}"))
        self._calls += 1
        return ParseStep(calls=[call])

    def _content(self, text: str) -> str:
        """After a call, the whitespace between calls is no content."""
        return text if self._calls == 0 or text.strip() else ""
