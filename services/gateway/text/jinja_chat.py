"""Renders a checkpoint's own Jinja chat template, in the environment chat
templates are written for (a sandbox with trim_blocks/lstrip_blocks, loop
controls, `raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII),
without importing transformers (which pulls torch into the gateway)."""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


def _strftime_now(format_: str) -> str:
    return datetime.now().strftime(format_)


@lru_cache(maxsize=4)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def render_chat(source: str, messages: list[dict[str, Any]], add_generation_prompt: bool,
                special_tokens: dict[str, str], tools: list[dict[str, Any]] | None = None) -> str:
    """The conversation as the template writes it; the special tokens
    (bos_token, eos_token...) and `tools` (None when the request has none) are
    visible to the template by name."""
    return compile_template(source).render(messages=messages, tools=tools, documents=None,
                                           add_generation_prompt=add_generation_prompt,
                                           **special_tokens)
