"""Turning prompts and chat messages into prompt token ids.

The checkpoint's own chat template wins. Without one (the converted Gemma 3
GGUF ships none), Gemma's turn format is used:
  <bos><start_of_turn>user\n{text}<end_of_turn>\n<start_of_turn>model\n
with a system message folded into the first user turn, as Gemma's template does.
"""

from __future__ import annotations

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
class ChatMessage:
    role: str
    content: str


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def raw_prompt_ids(tokenizer: Any, prompt: str) -> list[int]:
    """The prompt as is, with BOS when the tokenizer adds one."""
    return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])


def user_turn_ids(tokenizer: Any, prompt: str) -> list[int]:
    return chat_prompt_ids(tokenizer, [ChatMessage("user", prompt)])


def chat_prompt_ids(tokenizer: Any, messages: Sequence[ChatMessage]) -> list[int]:
    if not messages:
        raise ChatTemplateError("messages must not be empty")
    if has_chat_template(tokenizer):
        return _template_ids(tokenizer, messages)
    return _gemma_turn_ids(tokenizer, messages)


def _template_ids(tokenizer: Any, messages: Sequence[ChatMessage]) -> list[int]:
    conversation = [{"role": message.role, "content": message.content} for message in messages]
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False,
                                             add_generation_prompt=True)
    except Exception as error:  # jinja raises for e.g. roles out of order
        raise ChatTemplateError(f"chat template failed: {error}") from error
    # The template writes BOS itself when the model wants one.
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def gemma_turn_text(messages: Sequence[ChatMessage]) -> str:
    system_parts = [message.content.strip() for message in messages
                    if message.role in SYSTEM_ROLES]
    system_prefix = "\n\n".join(part for part in system_parts if part)
    turns = [message for message in messages if message.role not in SYSTEM_ROLES]
    if not turns:
        raise ChatTemplateError("messages need at least one user turn")
    pieces: list[str] = []
    for index, message in enumerate(turns):
        role = _ROLE_NAMES.get(message.role)
        if role is None:
            raise ChatTemplateError(f"unsupported message role {message.role!r}")
        content = message.content.strip()
        if index == 0 and system_prefix:
            content = f"{system_prefix}\n\n{content}"
        pieces.append(f"{START_OF_TURN}{role}\n{content}{END_OF_TURN}\n")
    pieces.append(f"{START_OF_TURN}model\n")
    return "".join(pieces)


def _gemma_turn_ids(tokenizer: Any, messages: Sequence[ChatMessage]) -> list[int]:
    ids = list(tokenizer(gemma_turn_text(messages), add_special_tokens=False)["input_ids"])
    bos = getattr(tokenizer, "bos_token_id", None)
    return [bos, *ids] if bos is not None else ids


def turn_stop_token_ids(tokenizer: Any) -> tuple[int, ...]:
    """Ids that end a model turn in chat mode, besides the model's EOS."""
    token_id = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    unknown = getattr(tokenizer, "unk_token_id", None)
    if token_id is None or token_id == unknown:
        return ()
    return (int(token_id),)
