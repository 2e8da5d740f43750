"""The Hermes / Qwen convention: each call is a JSON object
{"name": ..., "arguments": {...}} between <tool_call> and </tool_call>, with
any content before, between or after the calls."""

from __future__ import annotations

import json
import re
from typing import Any

from services.gateway.tool_parsers.base import ParseStep, ParsedCall, ToolCallParser

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"
# A call written name first, its arguments an object: what can be streamed.
CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)')
_TRAILING = " \t\r\n}"


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


def _without_call_end(text: str) -> str:
    """A streamed call's arguments: its text up to the brace that closes the call
    (when the model wrote one: the arguments alone may already be whole JSON)."""
    if text.endswith("}"):
        inner = text[:-1].rstrip()
        for candidate in (inner, text):
            try:
                json.loads(candidate)
            except ValueError:
                continue
            return candidate
        return inner
    return text


def _headed_call(body: str) -> ParsedCall | None:
    """A call written name first whose object the model left unclosed, read as
    a streamed one is: {"name": "f", "arguments": {"a": 1}</tool_call>."""
    head = CALL_HEAD.match(body)
    if head is None:
        return None
    try:
        arguments = json.loads(_without_call_end(body[head.end():].rstrip()))
    except ValueError:
        return None
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(head.group(1), json.dumps(arguments, ensure_ascii=False))


class HermesToolParser(ToolCallParser):
    """With `incremental`, a call whose text opens {"name": ..., "arguments": {
    is passed on as it comes: its name at once, then its arguments' text as it
    grows (the trailing braces held back until the call's end shows which one
    closes the call). Without it, or for a call written any other way, each
    call is passed on whole, checked, once its closing tag arrives."""

    def __init__(self, incremental: bool = False) -> None:
        super().__init__(incremental)
        self._pending = ""        # text not yet passed on (in a call: the call's text so far)
        self._in_call = False
        self._calls = 0
        self._arguments_at: int | None = None   # a streamed call: where its arguments start
        self._sent = 0                          # of those, the characters passed on

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
                if self.incremental:   # however the text was split, a streamable call streams
                    step = step.then(self._stream(before))
                step = step.then(self._close(before))
            else:
                step.content += self._content(before)
            self._in_call = not self._in_call
        if self._in_call:
            if self.incremental:
                step = step.then(self._stream(self._pending))
        else:
            keep = _held_prefix(self._pending, OPEN_TAG)
            step.content += self._content(self._pending[:len(self._pending) - keep])
            self._pending = self._pending[len(self._pending) - keep:]
        return step

    def finish(self) -> ParseStep:
        pending, self._pending = self._pending, ""
        if self._in_call:   # the reply ended inside a call (its end of turn cut the tag)
            self._in_call = False
            step = self._stream(pending) if self.incremental else ParseStep()
            return step.then(self._close(pending))
        return ParseStep(self._content(pending))

    def _stream(self, body: str) -> ParseStep:
        step = ParseStep()
        if self._arguments_at is None:
            head = CALL_HEAD.match(body)
            if head is None:
                return step
            self._arguments_at, self._sent = head.end(), 0
            self._calls += 1
            step.calls.append(ParsedCall(head.group(1), ""))
        visible = body[:len(body) - _held_prefix(body, CLOSE_TAG)]
        arguments = visible[self._arguments_at:].rstrip(_TRAILING)
        if len(arguments) > self._sent:
            step.calls.append(ParsedCall(None, arguments[self._sent:]))
            self._sent = len(arguments)
        return step

    def _close(self, body: str) -> ParseStep:
        if self._arguments_at is not None:   # streamed: the rest, less the call's own closing brace
            arguments = _without_call_end(body[self._arguments_at:].rstrip())
            rest, self._arguments_at = arguments[self._sent:], None
            return ParseStep(calls=[ParsedCall(None, rest)] if rest else [])
        call = parse_call(body.strip()) or _headed_call(body)
        if call is None:   # not a call after all: the text stays content, tags and all
            return ParseStep(self._content(f"{OPEN_TAG}{body}{CLOSE_TAG}"))
        self._calls += 1
        return ParseStep(calls=[call])

    def _content(self, text: str) -> str:
        """After a call, the whitespace between calls is no content."""
        return text if self._calls == 0 or text.strip() else ""
