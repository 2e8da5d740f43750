"""Tool calling on /v1/chat/completions, the request side: the tools a client
offers, checked (a 400 naming the tool and field), tool_choice resolved, the
calls of earlier assistant messages read back, and the JSON schema a required
call's output is constrained to."""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from services.gateway.text.chat_template import ToolCallRecord
from services.gateway.errors import bad_request
from services.gateway.requests.schemas import ToolBody, ToolCallBody, ToolChoiceBody

TOOL_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
MAX_TOOLS = 128
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


class ToolMode(StrEnum):
    NONE = "none"           # the reply is text; tools are only shown to the model
    AUTO = "auto"           # the model may call: its text is parsed for calls
    REQUIRED = "required"   # at least one call, of any tool: decoding is constrained
    NAMED = "named"         # one call of this tool: decoding is constrained


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict[str, Any]

    def as_template(self) -> dict[str, Any]:
        """The tool as chat templates (and the OpenAI request) spell it."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolChoice:
    mode: ToolMode
    name: str | None = None     # NAMED: the tool to call
    parallel: bool = True       # False: at most one call

    @property
    def constrained(self) -> bool:
        return self.mode in (ToolMode.REQUIRED, ToolMode.NAMED)


def check_tools(tools: Sequence[ToolBody] | None) -> tuple[Tool, ...]:
    if not tools:
        return ()
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"At most {MAX_TOOLS} tools per request, got {len(tools)}.", "tools")
    checked: dict[str, Tool] = {}
    for index, tool in enumerate(tools):
        param = f"tools.{index}"
        if tool.type != "function":
            raise bad_request(f"Only tools of type 'function' are supported, got {tool.type!r}.",
                              f"{param}.type")
        name = tool.function.name
        if not TOOL_NAME.match(name):
            raise bad_request(f"Tool names are 1-64 letters, digits, '_', '.' or '-', got {name!r}.",
                              f"{param}.function.name")
        if name in checked:
            raise bad_request(f"Two tools are named {name!r}.", f"{param}.function.name")
        parameters = tool.function.parameters
        if parameters is not None and parameters.get("type", "object") != "object":
            raise bad_request(f"A function's parameters must be a JSON schema of an object, got "
                              f"type {parameters.get('type')!r}.", f"{param}.function.parameters")
        checked[name] = Tool(name, tool.function.description,
                             dict(parameters) if parameters is not None else dict(EMPTY_PARAMETERS))
    return tuple(checked.values())


def resolve_tool_choice(choice: str | ToolChoiceBody | None, tools: Sequence[Tool],
                        parallel: bool | None) -> ToolChoice:
    """OpenAI's defaults: "auto" with tools, "none" without."""
    parallel_calls = parallel is not False
    if choice is None:
        return ToolChoice(ToolMode.AUTO if tools else ToolMode.NONE, parallel=parallel_calls)
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise bad_request(f"tool_choice must be 'none', 'auto', 'required' or a named "
                              f"function, got {choice!r}.", "tool_choice")
        mode = ToolMode(choice)
    else:
        if choice.type != "function":
            raise bad_request(f"A named tool_choice has type 'function', got {choice.type!r}.",
                              "tool_choice.type")
        mode = ToolMode.NAMED
    if mode is not ToolMode.NONE and not tools:
        raise bad_request(f"tool_choice {choice if isinstance(choice, str) else 'function'!r} "
                          "needs tools.", "tool_choice")
    if mode is ToolMode.NAMED:
        assert isinstance(choice, ToolChoiceBody)
        name = choice.function.name
        if name not in {tool.name for tool in tools}:
            raise bad_request(f"tool_choice names {name!r}, which is not among the tools.",
                              "tool_choice.function.name")
        return ToolChoice(mode, name, parallel=False)
    return ToolChoice(mode, parallel=parallel_calls)


def call_schema(tools: Sequence[Tool], choice: ToolChoice) -> dict[str, Any]:
    """The JSON schema a constrained reply follows: an array of calls, each
    {"name": <a tool's name>, "arguments": <that tool's parameters>}."""
    offered = [tool for tool in tools if choice.mode is not ToolMode.NAMED or tool.name == choice.name]
    calls = [{"type": "object",
              "properties": {"name": {"const": tool.name}, "arguments": tool.parameters},
              "required": ["name", "arguments"], "additionalProperties": False}
             for tool in offered]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not choice.parallel:
        schema["maxItems"] = 1
    return schema


def message_tool_calls(calls: Sequence[ToolCallBody] | None, param: str) -> tuple[ToolCallRecord, ...]:
    """An assistant message's earlier calls, with arguments parsed for the template."""
    records: list[ToolCallRecord] = []
    for index, call in enumerate(calls or ()):
        where = f"{param}.{index}"
        if call.type != "function":
            raise bad_request(f"Only function tool calls are supported, got {call.type!r}.",
                              f"{where}.type")
        try:
            arguments = json.loads(call.function.arguments)
        except ValueError as error:
            raise bad_request(f"A tool call's arguments must be JSON text: {error}.",
                              f"{where}.function.arguments") from None
        records.append(ToolCallRecord(call.id, call.function.name, arguments))
    return tuple(records)


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"
