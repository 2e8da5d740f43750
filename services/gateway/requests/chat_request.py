"""A /v1/chat/completions body read into what the gateway acts on: the
messages for the chat template (earlier tool calls and tool results
included), the tools and the tool_choice, and how the reply's calls are read."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from common.grammar import json_schema_constraint
from services.gateway.text.chat_template import ChatMessage, template_takes_tools
from services.gateway.requests.chat_tools import (
    Tool,
    ToolChoice,
    ToolMode,
    call_schema,
    check_tools,
    message_tool_calls,
    resolve_tool_choice,
)
from services.gateway.errors import bad_request
from services.gateway.streaming.generation import TextDelta
from services.gateway.requests.schemas import ChatCompletionBody, ChatMessageBody, ToolBody
from services.gateway.requests.spec import RequestFields
from services.gateway.tool_parsers import PARSERS
from services.gateway.tool_parsers.constrained import ConstrainedCallsParser
from services.gateway.tool_parsers.base import ToolCallParser
from services.gateway.text.tool_stream import with_tool_calls
from services.gateway.requests.validation import check_text

Deltas = AsyncIterator[tuple[int, TextDelta]]


@dataclass(frozen=True)
class ChatRequest:
    messages: tuple[ChatMessage, ...]
    tools: tuple[Tool, ...]
    choice: ToolChoice

    @property
    def template_tools(self) -> list[dict[str, Any]]:
        return [tool.as_template() for tool in self.tools]


def read_chat(body: ChatCompletionBody, tokenizer: Any) -> ChatRequest:
    tools = checked_tools(body.tools, tokenizer)
    choice = resolve_tool_choice(body.tool_choice, tools, body.parallel_tool_calls)
    return ChatRequest(read_messages(body.messages), tools, choice)


def checked_tools(tools: Sequence[ToolBody] | None, tokenizer: Any) -> tuple[Tool, ...]:
    """The tools, when the chat template can show them to the model."""
    checked = check_tools(tools)
    if checked and not template_takes_tools(tokenizer):
        raise bad_request("This model's chat template does not write tools into the prompt, so "
                          "the model would never see them.", "tools", "unsupported_parameter")
    return checked


def read_messages(messages: Sequence[ChatMessageBody]) -> tuple[ChatMessage, ...]:
    return tuple(chat_message(message, index) for index, message in enumerate(messages))


def chat_message(message: ChatMessageBody, index: int) -> ChatMessage:
    param = f"messages.{index}.content"
    calls = message_tool_calls(message.tool_calls, f"messages.{index}.tool_calls")
    if calls and message.role != "assistant":
        raise bad_request(f"Only assistant messages carry tool_calls; message {index} is "
                          f"{message.role!r}.", f"messages.{index}.tool_calls")
    if message.role == "tool" and not message.tool_call_id:
        raise bad_request(f"A tool message needs the tool_call_id it answers; message {index} "
                          "has none.", f"messages.{index}.tool_call_id", "missing_tool_call_id")
    content = message.content
    if content is None:
        if not calls:
            raise bad_request(f"Each message needs content; message {index} has none.", param,
                              "missing_content")
        content = ""
    return ChatMessage(message.role, _text(content, param), calls, message.tool_call_id,
                       message.name)


def _text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return check_text(content, param)
    texts: list[str] = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise bad_request(f"Only text content parts are supported, got {part.type!r}.",
                              param, "unsupported_content")
        texts.append(check_text(part.text, param))
    return "\n".join(texts)


def constrain_tool_call(fields: RequestFields, chat: ChatRequest) -> RequestFields:
    """A required call (tool_choice "required" or a named function): the reply
    is constrained to call_schema's JSON, an array of {"name", "arguments"}
    whose arguments follow the tool's parameters schema."""
    if not chat.choice.constrained:
        return fields
    if fields.constraint is not None:
        raise bad_request(f"tool_choice {_choice_name(chat.choice)} constrains the reply to tool "
                          f"calls, and {fields.constraint_param} constrains it too; send one of them.",
                          "tool_choice")
    return dataclasses.replace(
        fields, constraint=json_schema_constraint(call_schema(chat.tools, chat.choice)),
        constraint_param="tools")


def _choice_name(choice: ToolChoice) -> str:
    return f"'{choice.mode}'" if choice.mode is not ToolMode.NAMED else f"function {choice.name!r}"


def call_reader(chat: ChatRequest, parser_name: str,
                stream: bool = False) -> Callable[[Deltas, int], Deltas] | None:
    """How the reply's deltas get their calls: the parser of the template's
    convention when the model may call (streamed replies get their calls in
    pieces as they come), the JSON of a constrained reply when it must,
    nothing when it may not."""
    if chat.choice.mode is ToolMode.NONE:
        return None
    parser = ConstrainedCallsParser if chat.choice.constrained else PARSERS[parser_name]
    make: Callable[[], ToolCallParser] = functools.partial(parser, incremental=stream)
    return functools.partial(_read_calls, make=make,
                             max_calls=None if chat.choice.parallel else 1)


def _read_calls(merged: Deltas, count: int, make: Callable[[], ToolCallParser],
                max_calls: int | None) -> Deltas:
    return with_tool_calls(merged, make, count, max_calls)
