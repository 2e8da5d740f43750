"""The /v1/responses create body. Types only (a wrong type is a 422); what
the server does not implement is refused in translate.py with a 400 naming
the field."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class ResponseCreateBody(BaseModel):
    """Unknown fields are kept (model_extra) to be refused by name."""
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = None
    background: bool | None = None
    store: bool | None = None
    text: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
