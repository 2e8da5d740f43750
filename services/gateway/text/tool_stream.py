"""Tool calls in a chat reply's stream: each choice's text goes through its
own parser, which passes content on, holds back what may be a call, and turns
a complete call into a ToolCall on the delta. A choice that called ends with
finish_reason "tool_calls"."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing

from services.gateway.requests.chat_tools import new_call_id
from services.gateway.streaming.generation import TextDelta
from services.gateway.tool_parsers.base import ParseStep, ToolCall, ToolCallParser


async def with_tool_calls(merged: AsyncIterator[tuple[int, TextDelta]],
                          make_parser: Callable[[], ToolCallParser], count: int,
                          max_calls: int | None = None) -> AsyncIterator[tuple[int, TextDelta]]:
    """`merged` (index, delta) of `count` choices, with their calls parsed out;
    past `max_calls` calls a choice's further calls are dropped."""
    parsers = [make_parser() for _ in range(count)]
    calls = [0] * count
    async with aclosing(merged):  # type: ignore[type-var]
        async for index, delta in merged:
            step = parsers[index].feed(delta.text)
            if delta.finish_reason is not None:
                step = step.then(parsers[index].finish())
            made = _numbered(step, calls[index])
            calls[index] += sum(1 for call in made if call.id is not None)
            if max_calls is not None:
                made = tuple(call for call in made if call.index < max_calls)
            finish_reason = delta.finish_reason
            if finish_reason == "stop" and calls[index]:
                finish_reason = "tool_calls"
            yield index, dataclasses.replace(delta, text=step.content, tool_calls=made,
                                             finish_reason=finish_reason)


def _numbered(step: ParseStep, before: int) -> tuple[ToolCall, ...]:
    """Each new call takes the next index and an id; an arguments fragment goes
    with the call started last."""
    numbered: list[ToolCall] = []
    index = before - 1
    for piece in step.calls:
        if piece.name is not None:
            index += 1
            numbered.append(ToolCall(index, new_call_id(), piece.name, piece.arguments))
        elif piece.arguments:
            numbered.append(ToolCall(index, None, None, piece.arguments))
    return tuple(numbered)
