"""The OpenAI endpoints' response shapes: the envelope, choices, chunks,
usage and logprobs of /v1/completions and /v1/chat/completions."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from common.types import TokenLogprob, Usage
from services.gateway.requests.backend import TokenOutput
from services.gateway.text.detokenizer import token_bytes
from services.gateway.streaming.generation import TextDelta
from services.gateway.requests.prompt_scores import prompt_logprobs_json
from services.gateway.models.lora_catalog import AdapterEntry
from services.gateway.state import GatewayState
from services.gateway.tenancy.tenants import Tenant
from services.gateway.tool_parsers.base import ToolCall


@dataclass
class ChoiceResult:
    text: list[str] = field(default_factory=list)
    tokens: list[TokenOutput] = field(default_factory=list)
    finish_reason: str = ""
    usage: Usage = Usage(0, 0, 0)
    tool_calls: list[ToolCall] = field(default_factory=list)
    prompt_token_ids: tuple[int, ...] = ()
    prompt_logprobs: tuple[TokenLogprob, ...] = ()   # as the worker scored them (prompt_scores.py)


@dataclass(frozen=True)
class RequestInfo:
    request_id: str
    supplied: bool
    tenant: Tenant | None
    created: int
    model: str
    adapter: AdapterEntry | None = None    # the LoRA adapter `model` names (None: the base model)


def finite(value: float) -> float | None:
    """A logprob as JSON can carry it: NaN and infinities (which json.dumps
    would write as the invalid NaN / Infinity, or refuse) become null."""
    return value if math.isfinite(value) else None


def openai_usage(usage: Usage) -> dict[str, Any]:
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


class Format(ABC):
    """Shapes chunks and responses for one endpoint."""

    object_name = ""
    chunk_object_name = ""

    def __init__(self, state: GatewayState, response_id: str, info: RequestInfo,
                 logprobs: bool, prompt_logprobs: int | None = None) -> None:
        self.state = state
        self.response_id = response_id
        self.info = info
        self.logprobs = logprobs
        self.prompt_logprobs = prompt_logprobs   # vLLM's: alternatives per prompt token; None: not asked

    def _envelope(self, object_name: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.response_id, "object": object_name, "created": self.info.created,
                "model": self.info.model, "choices": choices}

    def _chunk(self, choice: dict[str, Any], include_usage: bool) -> dict[str, Any]:
        chunk = self._envelope(self.chunk_object_name, [choice])
        if include_usage:
            chunk["usage"] = None
        return chunk

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        chunk = self._envelope(self.chunk_object_name, [])
        chunk["usage"] = openai_usage(usage)
        return chunk

    def response(self, results: Sequence[ChoiceResult], usage: Usage) -> dict[str, Any]:
        body = self._envelope(self.object_name, [self.choice(index, result)
                                                 for index, result in enumerate(results)])
        body["usage"] = openai_usage(usage)
        return body

    def token_text(self, token_id: int) -> str:
        return self.state.service.token_text(token_id)

    def scored_prompt(self, result: ChoiceResult) -> list[dict[str, Any] | None]:
        """vLLM's prompt_logprobs of `result`'s prompt (prompt_scores.py)."""
        return prompt_logprobs_json(result.prompt_token_ids, result.prompt_logprobs,
                                    self.prompt_logprobs or 0, self.token_text)

    @abstractmethod
    def opening_chunk(self, index: int, include_usage: bool) -> dict[str, Any] | None:
        """Implemented per endpoint."""

    @abstractmethod
    def delta_chunk(self, index: int, delta: TextDelta, include_usage: bool) -> dict[str, Any]:
        """Implemented per endpoint."""

    @abstractmethod
    def finish_chunk(self, index: int, finish_reason: str, include_usage: bool) -> dict[str, Any]:
        """Implemented per endpoint."""

    @abstractmethod
    def choice(self, index: int, result: ChoiceResult) -> dict[str, Any]:
        """Implemented per endpoint."""


class CompletionFormat(Format):
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def opening_chunk(self, index: int, include_usage: bool) -> dict[str, Any] | None:
        return None

    def delta_chunk(self, index: int, delta: TextDelta, include_usage: bool) -> dict[str, Any]:
        return self._chunk({"index": index, "text": delta.text,
                            "logprobs": self._logprobs(delta.tokens), "finish_reason": None},
                           include_usage)

    def finish_chunk(self, index: int, finish_reason: str, include_usage: bool) -> dict[str, Any]:
        return self._chunk({"index": index, "text": "", "logprobs": None,
                            "finish_reason": finish_reason}, include_usage)

    def choice(self, index: int, result: ChoiceResult) -> dict[str, Any]:
        choice = {"index": index, "text": "".join(result.text),
                  "logprobs": self._logprobs(result.tokens), "finish_reason": result.finish_reason}
        if self.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self.scored_prompt(result)
        return choice

    def _logprobs(self, tokens: Sequence[TokenOutput]) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        texts = [self.token_text(token.token_id) for token in tokens]
        offsets, position = [], 0
        for text in texts:
            offsets.append(position)
            position += len(text)
        return {
            "tokens": texts,
            "token_logprobs": [finite(token.logprob.logprob) if token.logprob else None
                               for token in tokens],
            "top_logprobs": [
                {self.token_text(top.token_id): finite(top.logprob) for top in token.logprob.top}
                if token.logprob else None for token in tokens],
            "text_offset": offsets,
        }


class ChatFormat(Format):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def response(self, results: Sequence[ChoiceResult], usage: Usage) -> dict[str, Any]:
        body = super().response(results, usage)
        if self.prompt_logprobs is not None and results:   # vLLM's: the response's, one prompt
            body["prompt_logprobs"] = self.scored_prompt(results[0])
        return body

    def opening_chunk(self, index: int, include_usage: bool) -> dict[str, Any] | None:
        return self._chunk({"index": index, "delta": {"role": "assistant", "content": ""},
                            "logprobs": None, "finish_reason": None}, include_usage)

    def delta_chunk(self, index: int, delta: TextDelta, include_usage: bool) -> dict[str, Any]:
        message: dict[str, Any] = {"content": delta.text} if delta.text or not delta.tool_calls else {}
        if delta.tool_calls:
            message["tool_calls"] = [{"index": call.index, **_tool_call(call)}
                                     for call in delta.tool_calls]
        return self._chunk({"index": index, "delta": message,
                            "logprobs": self._logprobs(delta.tokens), "finish_reason": None},
                           include_usage)

    def finish_chunk(self, index: int, finish_reason: str, include_usage: bool) -> dict[str, Any]:
        return self._chunk({"index": index, "delta": {}, "logprobs": None,
                            "finish_reason": finish_reason}, include_usage)

    def choice(self, index: int, result: ChoiceResult) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": "".join(result.text)}
        if result.tool_calls:   # OpenAI's: no content beside the calls is null
            message["content"] = message["content"].strip() or None
            message["tool_calls"] = [_tool_call(call) for call in _whole(result.tool_calls)]
        return {"index": index, "message": message,
                "logprobs": self._logprobs(result.tokens), "finish_reason": result.finish_reason}

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token_id)
        return {"token": text, "logprob": finite(logprob),
                "bytes": list(token_bytes(self.state.tokenizer, token_id, text))}

    def _logprobs(self, tokens: Sequence[TokenOutput]) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        content = []
        for token in tokens:
            if token.logprob is None:
                continue
            entry = self._entry(token.token_id, token.logprob.logprob)
            entry["top_logprobs"] = [self._entry(top.token_id, top.logprob)
                                     for top in token.logprob.top]
            content.append(entry)
        return {"content": content}


def _tool_call(call: ToolCall) -> dict[str, Any]:
    if call.id is None:   # a streamed fragment of the call's arguments
        return {"function": {"arguments": call.arguments}}
    return {"id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def _whole(calls: Sequence[ToolCall]) -> list[ToolCall]:
    """Calls with their streamed fragments joined."""
    whole: dict[int, ToolCall] = {}
    for call in calls:
        if call.id is None and call.index in whole:
            known = whole[call.index]
            whole[call.index] = ToolCall(known.index, known.id, known.name,
                                         known.arguments + call.arguments)
        elif call.id is not None:
            whole[call.index] = call
    return [whole[index] for index in sorted(whole)]
