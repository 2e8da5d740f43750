"""A /v1/responses body read as the chat request it asks for: `input` (a
string or items) and `instructions` become chat messages after the
conversation of `previous_response_id`; `text.format` becomes the chat
`response_format` (the structured-output constraint), function `tools` and
`tool_choice` the chat tools (the tool-call parser reads the reply). Fields
this server does not implement are a 400 that names them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from services.gateway.errors import bad_request
from services.gateway.responses.body import ResponseCreateBody
from services.gateway.requests.schemas import ChatCompletionBody

# Fields of OpenAI's create body that ask for nothing with these values.
_NO_OPS: dict[str, tuple[Any, ...]] = {
    "truncation": ("disabled",), "service_tier": ("auto", "default"), "include": ([],),
    "stream_options": (), "prompt_cache_key": (), "safety_identifier": (),
}
_TEXT_PARTS = ("input_text", "output_text", "text")


def refuse_unimplemented(extra: Mapping[str, Any] | None) -> None:
    """400 naming the first field the server does not implement that asks for something."""
    for name, value in (extra or {}).items():
        if value is None or value in _NO_OPS.get(name, ()) or (name in _NO_OPS and not _NO_OPS[name]):
            continue
        raise bad_request(f"{name} is not supported by this server's /v1/responses.", name,
                          "unsupported_parameter")


def input_messages(body: ResponseCreateBody) -> list[dict[str, Any]]:
    """The body's input as chat messages (instructions not included)."""
    if isinstance(body.input, str):
        if not body.input:
            raise bad_request("input is empty.", "input", "empty_prompt")
        return [{"role": "user", "content": body.input}]
    if not body.input:
        raise bad_request("input is empty.", "input", "empty_prompt")
    messages: list[dict[str, Any]] = []
    for index, item in enumerate(body.input):
        _add_item(messages, item, f"input.{index}")
    return messages


def _add_item(messages: list[dict[str, Any]], item: Mapping[str, Any], param: str) -> None:
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "assistant", "system", "developer"):
            raise bad_request(f"{param}.role must be user, assistant, system or developer.", f"{param}.role")
        messages.append({"role": "system" if role == "developer" else role,
                         "content": _content(item.get("content"), f"{param}.content")})
    elif kind == "function_call":
        call = {"id": _text_field(item, "call_id", param), "type": "function",
                "function": {"name": _text_field(item, "name", param),
                             "arguments": _text_field(item, "arguments", param)}}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
            last["tool_calls"].append(call)     # parallel calls: one assistant turn
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        messages.append({"role": "tool", "tool_call_id": _text_field(item, "call_id", param),
                         "content": _text_field(item, "output", param)})
    else:
        raise bad_request(f"input items of type {kind!r} are not supported by this server.", f"{param}.type",
                          "unsupported_parameter")


def _text_field(item: Mapping[str, Any], name: str, param: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise bad_request(f"{param}.{name} must be a string.", f"{param}.{name}")
    return value


def _content(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise bad_request(f"{param} must be a string or a list of text parts.", param)
    texts = []
    for index, part in enumerate(content):
        if not isinstance(part, Mapping) or part.get("type") not in _TEXT_PARTS \
                or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, Mapping) else None
            raise bad_request(f"Only text content parts are supported, got {kind!r}.", f"{param}.{index}.type",
                              "unsupported_content")
        texts.append(part["text"])
    return "\n".join(texts)


def response_format(text: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """text.format as the chat response_format (structured.py reads it)."""
    if text is None:
        return None
    for key in text:
        if key not in ("format", "verbosity"):
            raise bad_request(f"text.{key} is not supported by this server.", f"text.{key}", "unsupported_parameter")
    if text.get("verbosity") not in (None, "medium"):
        raise bad_request("text.verbosity is not supported by this server.", "text.verbosity",
                          "unsupported_parameter")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, Mapping) or not isinstance(fmt.get("type"), str):
        raise bad_request("text.format must be an object with a type.", "text.format")
    if fmt["type"] == "json_schema":
        if not isinstance(fmt.get("schema"), Mapping):
            raise bad_request("text.format.schema must be a JSON schema object.", "text.format.schema")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": dict(fmt["schema"])}}
    if fmt["type"] in ("text", "json_object"):
        return {"type": fmt["type"]}
    raise bad_request(f"text.format type {fmt['type']!r} is not supported; use text, json_object or "
                      "json_schema.", "text.format.type", "unsupported_parameter")


def chat_tools(tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Function tools in the chat shape; other tool types are refused."""
    if tools is None:
        return None
    converted = []
    for index, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise bad_request(f"tools of type {tool.get('type')!r} are not supported by this server; "
                              "only function tools are.", f"tools.{index}.type", "unsupported_parameter")
        function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool}
        converted.append({"type": "function", "function": function})
    return converted


def chat_tool_choice(choice: str | Mapping[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise bad_request("tool_choice must be none, auto, required or a function by name.", "tool_choice")
    return {"type": "function", "function": {"name": choice["name"]}}


def chat_body(body: ResponseCreateBody, messages: list[dict[str, Any]]) -> ChatCompletionBody:
    """The chat request the response body asks for, over `messages` (the whole conversation)."""
    if body.instructions:
        messages = [{"role": "system", "content": body.instructions}, *messages]
    fields: dict[str, Any] = {
        "messages": messages, "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "stream": bool(body.stream),
        "tools": chat_tools(body.tools), "tool_choice": chat_tool_choice(body.tool_choice),
        "parallel_tool_calls": body.parallel_tool_calls, "user": body.user,
        "response_format": response_format(body.text),
    }
    return ChatCompletionBody.model_validate({k: v for k, v in fields.items() if v is not None})
