"""Turning prompts and chat messages into prompt token ids.

The checkpoint's own chat template wins. Without one (the converted Gemma 3
GGUF ships none), Gemma's turn format is used:
  <bos><start_of_turn>user\n{text}<end_of_turn>\n<start_of_turn>model\n
with a system message folded into the first user turn, as Gemma's template does.
Tools (chat_tools.py) go to a template as its `tools` variable and earlier calls
and their results as the messages' tool_calls and role "tool", in the shapes
Hugging Face templates read; without a template they are written in the
Hermes convention that tool_parsers/hermes.py reads back.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

START_OF_TURN = "<start_of_turn>"
END_OF_TURN = "<end_of_turn>"
_ROLE_NAMES = {"user": "user", "assistant": "model", "model": "model"}
SYSTEM_ROLES = ("system", "developer")


class ChatTemplateError(ValueError):
    """The messages cannot be rendered (bad role order, unknown role...)."""


@dataclass(frozen=True)
class ToolCallRecord:
    """A call an assistant message made earlier in the conversation."""
    id: str
    name: str
    arguments: Any        # parsed from the JSON string the client sent


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str
    tool_calls: tuple[ToolCallRecord, ...] = ()
    tool_call_id: str | None = None     # role "tool": the call this result answers
    name: str | None = None


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def template_takes_tools(tokenizer: Any) -> bool:
    """Whether the tools a request offers reach the model: the built-in format
    writes them, a checkpoint's template only if it reads its `tools` variable."""
    return not has_chat_template(tokenizer) or "tools" in tokenizer.chat_template


def raw_prompt_ids(tokenizer: Any, prompt: str, add_special_tokens: bool = True) -> list[int]:
    """The prompt as is, with BOS when the tokenizer adds one (unless told not to)."""
    return list(tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"])


def with_special_tokens(tokenizer: Any, ids: list[int]) -> list[int]:
    """`ids` after the special tokens the tokenizer puts before any text (BOS), as vLLM's
    add_special_tokens does on top of a chat template."""
    return [*tokenizer("", add_special_tokens=True)["input_ids"], *ids]


def user_turn_ids(tokenizer: Any, prompt: str) -> list[int]:
    return chat_prompt_ids(tokenizer, [ChatMessage("user", prompt)])


def chat_prompt_ids(tokenizer: Any, messages: Sequence[ChatMessage],
                    tools: Sequence[dict[str, Any]] = (), add_generation_prompt: bool = True
                    ) -> list[int]:
    """`tools` in the OpenAI request's shape ({"type": "function", "function": {...}})."""
    if not messages:
        raise ChatTemplateError("messages must not be empty")
    if has_chat_template(tokenizer):
        return _template_ids(tokenizer, messages, tools, add_generation_prompt)
    return _gemma_turn_ids(tokenizer, messages, tools, add_generation_prompt)


def template_message(message: ChatMessage) -> dict[str, Any]:
    """A message as Hugging Face chat templates read it: a call's arguments as an
    object (templates write them with tojson)."""
    rendered: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        rendered["tool_calls"] = [
            {"id": call.id, "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}}
            for call in message.tool_calls]
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        rendered["name"] = message.name
    return rendered


def _template_ids(tokenizer: Any, messages: Sequence[ChatMessage],
                  tools: Sequence[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
    conversation = [template_message(message) for message in messages]
    extra = {"tools": list(tools)} if tools else {}
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False,
                                             add_generation_prompt=add_generation_prompt, **extra)
    except Exception as error:  # jinja raises for e.g. roles out of order
        raise ChatTemplateError(f"chat template failed: {error}") from error
    # The template writes BOS itself when the model wants one.
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def gemma_turn_text(messages: Sequence[ChatMessage], tools: Sequence[dict[str, Any]] = (),
                    add_generation_prompt: bool = True) -> str:
    system_parts = [message.content.strip() for message in messages
                    if message.role in SYSTEM_ROLES]
    if tools:
        system_parts.append(tools_preamble(tools))
    system_prefix = "\n\n".join(part for part in system_parts if part)
    turns = _merged_tool_turns([message for message in messages if message.role not in SYSTEM_ROLES])
    if not turns:
        raise ChatTemplateError("messages need at least one user turn")
    pieces: list[str] = []
    for index, (role, content) in enumerate(turns):
        if index == 0 and system_prefix:
            content = f"{system_prefix}\n\n{content}"
        pieces.append(f"{START_OF_TURN}{role}\n{content}{END_OF_TURN}\n")
    if add_generation_prompt:
        pieces.append(f"{START_OF_TURN}model\n")
    return "".join(pieces)


def _merged_tool_turns(messages: Sequence[ChatMessage]) -> list[tuple[str, str]]:
    """(Gemma role, text) per turn: an assistant's calls follow its text, and the
    results of consecutive tool messages share one user turn."""
    turns: list[tuple[str, str]] = []
    previous_tool = False
    for message in messages:
        if message.role == "tool":
            response = f"<tool_response>\n{message.content.strip()}\n</tool_response>"
            if previous_tool:
                turns[-1] = ("user", f"{turns[-1][1]}\n{response}")
            else:
                turns.append(("user", response))
            previous_tool = True
            continue
        previous_tool = False
        role = _ROLE_NAMES.get(message.role)
        if role is None:
            raise ChatTemplateError(f"unsupported message role {message.role!r}")
        parts = [message.content.strip()] if message.content.strip() else []
        parts += [hermes_call_text(call.name, call.arguments) for call in message.tool_calls]
        turns.append((role, "\n".join(parts)))
    return turns


def hermes_call_text(name: str, arguments: Any) -> str:
    call = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{call}\n</tool_call>"


def tools_preamble(tools: Sequence[dict[str, Any]]) -> str:
    """The tools as the built-in format offers them (Hermes' convention)."""
    listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return ("You may call one or more functions to answer. The functions, with JSON schemas of "
            f"their arguments, are inside <tools></tools>:\n<tools>\n{listed}\n</tools>\n"
            "To call a function, write a JSON object with its name and arguments inside "
            "<tool_call></tool_call> tags, one call per tag:\n<tool_call>\n"
            '{"name": <function name>, "arguments": <arguments object>}\n</tool_call>')


def _gemma_turn_ids(tokenizer: Any, messages: Sequence[ChatMessage],
                    tools: Sequence[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
    text = gemma_turn_text(messages, tools, add_generation_prompt)
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    bos = getattr(tokenizer, "bos_token_id", None)
    return [bos, *ids] if bos is not None else ids


def turn_stop_token_ids(tokenizer: Any) -> tuple[int, ...]:
    """Ids that end a model turn in chat mode, besides the model's EOS."""
    token_id = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    unknown = getattr(tokenizer, "unk_token_id", None)
    if token_id is None or token_id == unknown:
        return ()
    return (int(token_id),)
