"""Request bodies. Types only: a wrong type or a missing field is a schema
error (422); value ranges are checked in validation.py (400, with numbers),
fields the server does not implement in unsupported.py (400)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

StopField = str | list[str] | None


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ExtraSamplingFields(_Body):
    """Fields vLLM accepts beyond OpenAI's, plus fairserve's own. The request
    bodies keep unknown fields (model_extra) for unsupported.py to look at."""
    model_config = ConfigDict(extra="allow")

    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    priority: int | None = None
    session_id: str | None = None
    stop_token_ids: list[int] | None = None
    logit_bias: dict[str, float] | None = None   # OpenAI's: token id (a JSON key) -> bias


class GenerateBody(ExtraSamplingFields):
    prompt: str
    max_tokens: int | None = Field(default=None, description="default: DEFAULT_MAX_TOKENS (128)")
    stream: bool = True
    temperature: float | None = Field(default=None, description="default 0: greedy")
    top_p: float | None = None
    seed: int | None = None
    stop: StopField = None
    raw: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None


class StreamOptions(_Body):
    include_usage: bool | None = None


class CompletionBody(ExtraSamplingFields):
    model: str | None = None
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    logprobs: int | None = None
    echo: bool | None = None
    stop: StopField = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    user: str | None = None


class ContentPart(_Body):
    type: str
    text: str | None = None


class ChatMessageBody(_Body):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionBody(ExtraSamplingFields):
    model: str | None = None
    messages: list[ChatMessageBody]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    stop: StopField = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    user: str | None = None


class ModelCard(_Body):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "fairserve"
    max_model_len: int | None = None


class ModelList(_Body):
    object: Literal["list"] = "list"
    data: list[ModelCard]
