"""Request fields this server does not implement. Other servers' clients send
them (vLLM's guided decoding backend choice and beam search, among others);
ignoring them would answer a different question than the one asked, so each
is a 400 that names it, unless it is null or has its default value (which
asks for nothing). Unknown fields outside this list (`store`,
`metadata`, ...) change nothing about the answer and stay ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from services.gateway.errors import bad_request

# name: the values that ask for nothing beyond what the server does anyway
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    # OpenAI
    "tools": ([],),
    "tool_choice": ("none",),
    "functions": ([],),
    "function_call": ("none",),
    "parallel_tool_calls": (True,),
    "best_of": (1,),
    "suffix": ("",),
    "audio": (),
    "modalities": (["text"],),
    "prediction": (),
    "web_search_options": (),
    "reasoning_effort": (),
    "verbosity": ("medium",),
    # vLLM
    "guided_decoding_backend": (),
    "guided_whitespace_pattern": (),
    "use_beam_search": (False,),
    "length_penalty": (1.0,),
    "prompt_logprobs": (),              # /generate's; the OpenAI endpoints implement theirs
    "include_stop_str_in_output": (False,),
    "bad_words": ([],),
    "allowed_token_ids": (),
    "logits_processors": (),
    "truncate_prompt_tokens": (),
    "continue_final_message": (False,),
    "add_generation_prompt": (True,),
    "chat_template": (),
    "chat_template_kwargs": ({},),
    "documents": (),
    "echo": (False,),                   # chat's (the last message first); completions implement theirs
    "skip_special_tokens": (True,),     # replies leave special tokens out
    "spaces_between_special_tokens": (True,),
    "return_tokens_as_token_ids": (False,),
    "mm_processor_kwargs": (),
    "vllm_xargs": (),
}


def _asks_for_nothing(value: Any, defaults: tuple[Any, ...]) -> bool:
    # type() as well as ==: True == 1, and best_of=True is no default.
    return value is None or any(type(value) is type(default) and value == default
                                or (isinstance(default, float) and type(value) is int
                                    and value == default)
                                for default in defaults)


def reject_unsupported(extra: Mapping[str, Any] | None) -> None:
    """400 naming the first unsupported field the body sets to something."""
    for name, value in (extra or {}).items():
        defaults = UNSUPPORTED.get(name)
        if defaults is not None and not _asks_for_nothing(value, defaults):
            raise bad_request(f"{name} is not supported by this server.", name,
                              "unsupported_parameter")
