"""Tool-call parsers: content passed on, calls read out of a reply's text,
whole or in pieces, however the text is split between deltas."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from services.gateway.tool_parsers.constrained import ConstrainedCallsParser
from services.gateway.tool_parsers.hermes import HermesToolParser
from services.gateway.tool_parsers.base import ParseStep

CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'


def parse_all(parser: Any, pieces: list[str]) -> ParseStep:
    step = ParseStep()
    for piece in pieces:
        step = step.then(parser.feed(piece))
    return step.then(parser.finish())


def split_every_way(text: str) -> Iterator[list[str]]:
    yield [text]
    yield list(text)
    for cut in range(1, len(text)):
        yield [text[:cut], text[cut:]]


@pytest.mark.parametrize("text, content, calls", [
    ("Just text, no call.", "Just text, no call.", []),
    ("a < b <tool and <tool_cal", "a < b <tool and <tool_cal", []),
    (CALL_TEXT, "", [("get_weather", {"city": "Paris", "days": 2})]),
    (f"Let me check.\n{CALL_TEXT}\n{CALL_TEXT.replace('Paris', 'Rome')}", "Let me check.\n",
     [("get_weather", {"city": "Paris", "days": 2}), ("get_weather", {"city": "Rome", "days": 2})]),
    ('<tool_call>\n{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}', "",
     [("get_time", {"zone": "UTC"})]),                         # cut before its closing tag
    ('<tool_call>{"name": "get_time", "parameters": {"zone": "UTC"}}</tool_call>', "",
     [("get_time", {"zone": "UTC"})]),
    ("<tool_call>not json</tool_call> after", "<tool_call>not json</tool_call> after", []),
    ('<tool_call>{"name": "f", "arguments": {"a": 1}</tool_call>', "", [("f", {"a": 1})]),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
])
def test_hermes_parser_whatever_the_deltas(text: str, content: str,
                                           calls: list[tuple[str, dict[str, Any]]]) -> None:
    for pieces in split_every_way(text):
        step = parse_all(HermesToolParser(), pieces)
        assert step.content == content, pieces
        assert [(call.name, json.loads(call.arguments)) for call in step.calls] == calls, pieces


@pytest.mark.parametrize("text, content, calls", [
    (CALL_TEXT, "", [("get_weather", {"city": "Paris", "days": 2})]),
    (f"Let me check.\n{CALL_TEXT}\n{CALL_TEXT.replace('Paris', 'R}o{me')}", "Let me check.\n",
     [("get_weather", {"city": "Paris", "days": 2}), ("get_weather", {"city": "R}o{me", "days": 2})]),
    ('<tool_call>{"name": "get_time", "arguments": {"zone": {"id": "UTC"}}}', "",
     [("get_time", {"zone": {"id": "UTC"}})]),                  # cut before its closing tag
    ('<tool_call>{"name": "f", "arguments": {"a": [1, {}]}}   \n</tool_call>', "",
     [("f", {"a": [1, {}]})]),
    ('<tool_call>{"name": "f", "arguments": {"a": 1}</tool_call>', "", [("f", {"a": 1})]),
    ('<tool_call>\n{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}\n</tool_call>', "",
     [("get_time", {"zone": "UTC"})]),                          # not streamable: passed on whole
    ('<tool_call>{"arguments": {"zone": "UTC"}, "name": "get_time"}</tool_call>', "",
     [("get_time", {"zone": "UTC"})]),
])
def test_hermes_parser_streams_calls_in_pieces_whatever_the_deltas(
        text: str, content: str, calls: list[tuple[str, dict[str, Any]]]) -> None:
    for pieces in split_every_way(text):
        step = parse_all(HermesToolParser(incremental=True), pieces)
        assert step.content == content, pieces
        assert joined_calls(step) == calls, pieces


def test_a_streamed_call_shows_its_name_before_its_arguments_end() -> None:
    parser = HermesToolParser(incremental=True)
    assert parser.feed('<tool_call>\n{"name": "get_weather", "argu').calls == []
    started, first = parser.feed('ments": {"ci').calls
    assert (started.name, started.arguments) == ("get_weather", "")
    assert (first.name, first.arguments) == (None, '{"ci')
    assert parser.feed('ty": "Pa').calls[0].arguments == 'ty": "Pa'
    assert parser.feed('ris"}').calls[0].arguments == 'ris"'       # the braces wait
    [rest] = parser.feed('}\n</tool_call>').calls
    assert rest.name is None and rest.arguments == "}"


def test_hermes_parser_passes_content_on_as_it_comes() -> None:
    parser = HermesToolParser()
    assert parser.feed("Hello <to").content == "Hello "     # "<to" may open a call
    assert parser.feed("day").content == "<today"
    assert parser.feed(" <tool_call>{").content == " "
    step = parser.feed('"name": "f", "arguments": {}}</tool_call>')
    assert [call.name for call in step.calls] == ["f"]


def test_constrained_parser_reads_the_json_array() -> None:
    step = parse_all(ConstrainedCallsParser(), ['[{"name":"get_time",', '"arguments":{"zone":"UTC"}}]'])
    assert step.content == "" and [(c.name, json.loads(c.arguments)) for c in step.calls] == [
        ("get_time", {"zone": "UTC"})]
    cut = parse_all(ConstrainedCallsParser(), ['[{"name":"get_ti'])
    assert cut.content == '[{"name":"get_ti' and not cut.calls
    # Cut short after whole calls (max_tokens): those calls are kept.
    longer = parse_all(ConstrainedCallsParser(), [
        '[{"arguments":{"zone":"UTC"},"name":"get_time"}, {"name":"get_time","arguments":{"zone":"C'])
    assert [(c.name, json.loads(c.arguments)) for c in longer.calls] == [("get_time", {"zone": "UTC"})]
    assert longer.content == ""


def joined_calls(step: ParseStep) -> list[tuple[str, Any]]:
    joined: list[list[str]] = []
    for piece in step.calls:
        if piece.name is not None:
            joined.append([piece.name, piece.arguments])
        else:
            joined[-1][1] += piece.arguments
    return [(name, json.loads(arguments)) for name, arguments in joined]


@pytest.mark.parametrize("text, calls", [
    ('[{"name":"get_time","arguments":{"zone":"U}T\\"C"}}]', [("get_time", {"zone": 'U}T"C'})]),
    ('[{"name":"f","arguments":{"a":[1,{"b":{}}]}},{"name":"g","arguments":{}}]',
     [("f", {"a": [1, {"b": {}}]}), ("g", {})]),
    ('[{"arguments":{"zone":"UTC"},"name":"get_time"}]', [("get_time", {"zone": "UTC"})]),
])
def test_a_constrained_array_streams_its_calls_whatever_the_deltas(
        text: str, calls: list[tuple[str, Any]]) -> None:
    for pieces in split_every_way(text):
        step = parse_all(ConstrainedCallsParser(incremental=True), pieces)
        assert step.content == "" and joined_calls(step) == calls, pieces


def test_a_streamed_constrained_call_shows_its_name_first() -> None:
    parser = ConstrainedCallsParser(incremental=True)
    assert parser.feed('[{"name":"get_ti').calls == []
    assert parser.feed('me","arguments":').calls == []      # its arguments not begun yet
    started, first = parser.feed('{"zone":"UT').calls
    assert (started.name, started.arguments) == ("get_time", "")
    assert (first.name, first.arguments) == (None, '{"zone":"UT')
    assert [p.arguments for p in parser.feed('C"}}]').calls] == ['C"}']
    assert parser.finish().calls == []
