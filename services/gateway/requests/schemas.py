"""Request bodies. Types only: a wrong type or a missing field is a schema
error (422); value ranges are checked in validation.py (400, with numbers),
fields the server does not implement in unsupported.py (400)."""

from __future__ import annotations

from typing import Any, Literal

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
    kv_policy: str | None = None   # fairserve's: full | window | sink | h2o (else the deployment's KV_POLICY)
    # Structured output (structured.py): OpenAI's response_format, vLLM's guided_* and structured_outputs.
    response_format: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None


class GenerateBody(ExtraSamplingFields):
    model: str | None = Field(default=None, description="a served name or LoRA adapter; default: the base model")
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
    prompt_logprobs: int | None = None   # vLLM's (prompt_scores.py)
    stop: StopField = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    user: str | None = None
    add_special_tokens: bool = True     # vLLM's: the tokenizer's BOS before a text prompt


class ContentPart(_Body):
    type: str
    text: str | None = None


class FunctionCallBody(_Body):
    name: str
    arguments: str      # JSON text, as OpenAI sends it


class ToolCallBody(_Body):
    id: str
    type: str = "function"
    function: FunctionCallBody


class ChatMessageBody(_Body):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallBody] | None = None    # an assistant's calls
    tool_call_id: str | None = None                 # role "tool": the call it answers


class FunctionBody(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None        # a JSON schema of the arguments object
    strict: bool | None = None


class ToolBody(_Body):
    type: str
    function: FunctionBody


class NamedFunction(_Body):
    name: str


class ToolChoiceBody(_Body):
    type: str
    function: NamedFunction


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
    prompt_logprobs: int | None = None   # vLLM's (prompt_scores.py)
    stop: StopField = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    user: str | None = None
    tools: list[ToolBody] | None = None
    tool_choice: str | ToolChoiceBody | None = None
    parallel_tool_calls: bool | None = None
    add_special_tokens: bool = False    # vLLM's: the tokenizer's BOS on top of the template's


class _OpenBody(_Body):
    """Unknown fields kept (model_extra) for unsupported.py to look at."""
    model_config = ConfigDict(extra="allow")


class TokenizeBody(_OpenBody):
    """vLLM's /tokenize: a prompt, or chat messages (with tools) through the template."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageBody] | None = None
    tools: list[ToolBody] | None = None
    add_special_tokens: bool | None = None      # default: true for a prompt, false for messages
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeBody(_OpenBody):
    model: str | None = None
    tokens: list[int]


class ModelCard(_Body):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "fairserve"
    max_model_len: int | None = None
    root: str | None = None
    parent: str | None = None       # a LoRA adapter's base model (vLLM's field); None for the base


class ModelList(_Body):
    object: Literal["list"] = "list"
    data: list[ModelCard]
