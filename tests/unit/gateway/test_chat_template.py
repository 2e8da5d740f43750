from __future__ import annotations

import copy
from typing import Any

import pytest

from services.gateway.text.chat_template import (
    ChatMessage,
    ChatTemplateError,
    chat_prompt_ids,
    gemma_turn_text,
    raw_prompt_ids,
    turn_stop_token_ids,
    user_turn_ids,
)


def test_user_turn_uses_gemma_format_with_bos(tokenizer: Any) -> None:
    ids = user_turn_ids(tokenizer, "Hi there")
    assert ids[0] == tokenizer.bos_token_id
    text = tokenizer.decode(ids[1:], skip_special_tokens=False)
    assert text == "<start_of_turn>user\nHi there<end_of_turn>\n<start_of_turn>model\n"
    assert ids[1] == tokenizer.convert_tokens_to_ids("<start_of_turn>")


def test_system_message_folds_into_the_first_user_turn() -> None:
    text = gemma_turn_text([ChatMessage("system", "Be brief."), ChatMessage("user", "Hi"),
                            ChatMessage("assistant", "Hello."), ChatMessage("user", "Bye")])
    assert text == ("<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
                    "<start_of_turn>model\nHello.<end_of_turn>\n"
                    "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")


def test_unknown_role_and_empty_messages_are_rejected(tokenizer: Any) -> None:
    with pytest.raises(ChatTemplateError):
        chat_prompt_ids(tokenizer, [ChatMessage("narrator", "x")])
    with pytest.raises(ChatTemplateError):
        chat_prompt_ids(tokenizer, [])
    with pytest.raises(ChatTemplateError):
        chat_prompt_ids(tokenizer, [ChatMessage("system", "only a system prompt")])


def test_raw_prompt_is_sent_as_is_with_bos(tokenizer: Any) -> None:
    ids = raw_prompt_ids(tokenizer, "The capital of France is")
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids[1:]) == "The capital of France is"


def test_checkpoint_chat_template_wins(tokenizer: Any) -> None:
    templated = copy.deepcopy(tokenizer)
    templated.chat_template = ("{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}"
                               "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")
    ids = chat_prompt_ids(templated, [ChatMessage("user", "Hi")])
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    assert templated.decode(ids[1:]) == "[user]Hi[assistant]"


def test_turn_stop_token_is_end_of_turn(tokenizer: Any) -> None:
    assert turn_stop_token_ids(tokenizer) == (tokenizer.convert_tokens_to_ids("<end_of_turn>"),)
