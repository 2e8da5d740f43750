"""A response object and its stream of events, in OpenAI's names and order:
response.created, response.in_progress, then per output item
response.output_item.added, (a message) response.content_part.added,
response.output_text.delta..., response.output_text.done,
response.content_part.done, (a function call)
response.function_call_arguments.delta/done, response.output_item.done; and
last response.completed (or response.incomplete past max_output_tokens,
response.failed on an error). The store numbers them (sequence_number).

Pure: built from generation deltas; no transport."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from common.types import Usage
from services.gateway.streaming.generation import TextDelta


@dataclass
class ResponseBuilder:
    response_id: str
    created_at: int
    model: str
    echo: dict[str, Any]           # the request's fields a response object repeats
    status: str = "queued"
    output: list[dict[str, Any]] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    error: dict[str, str] | None = None
    incomplete_details: dict[str, str] | None = None
    _message: dict[str, Any] | None = None        # the message item being written
    _calls: dict[int, dict[str, Any]] = field(default_factory=dict)   # parser index -> function_call item

    def snapshot(self) -> dict[str, Any]:
        """The response object as it stands."""
        return {"id": self.response_id, "object": "response", "created_at": self.created_at,
                "status": self.status, "model": self.model, "output": [dict(item) for item in self.output],
                "usage": self.usage, "error": self.error, "incomplete_details": self.incomplete_details,
                "output_text": "".join(part["text"] for item in self.output if item["type"] == "message"
                                       for part in item["content"]),
                **self.echo}

    def start(self) -> list[dict[str, Any]]:
        self.status = "in_progress"
        return [{"type": "response.created", "response": self.snapshot()},
                {"type": "response.in_progress", "response": self.snapshot()}]

    def delta(self, delta: TextDelta) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if delta.text:
            events += self._text(delta.text)
        for call in delta.tool_calls:
            events += self._call(call.index, call.id, call.name, call.arguments)
        return events

    def finish(self, finish_reason: str, usage: Usage | None) -> list[dict[str, Any]]:
        events = self._close_items()
        self.usage = _usage(usage)
        if finish_reason == "length":
            self.status, self.incomplete_details = "incomplete", {"reason": "max_output_tokens"}
            return events + [{"type": "response.incomplete", "response": self.snapshot()}]
        self.status = "completed"
        return events + [{"type": "response.completed", "response": self.snapshot()}]

    def fail(self, code: str, message: str) -> list[dict[str, Any]]:
        events = self._close_items("incomplete")
        self.status, self.error = "failed", {"code": code, "message": message}
        return events + [{"type": "response.failed", "response": self.snapshot()}]

    def cancel(self) -> None:
        self._close_items("incomplete")
        self.status = "cancelled"

    # ---- items ----

    def _text(self, text: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if self._message is None:
            self._message = {"id": self._item_id("msg", len(self.output)), "type": "message", "status": "in_progress",
                             "role": "assistant", "content": []}
            index = len(self.output)
            self.output.append(self._message)
            events.append({"type": "response.output_item.added", "output_index": index,
                           "item": {**self._message, "content": []}})
            self._message["content"].append({"type": "output_text", "text": "", "annotations": []})
            events.append({"type": "response.content_part.added", "item_id": self._message["id"],
                           "output_index": index, "content_index": 0,
                           "part": {"type": "output_text", "text": "", "annotations": []}})
        self._message["content"][0]["text"] += text
        events.append({"type": "response.output_text.delta", "item_id": self._message["id"],
                       "output_index": self.output.index(self._message), "content_index": 0, "delta": text,
                       "logprobs": []})
        return events

    def _call(self, index: int, call_id: str | None, name: str | None, arguments: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        item = self._calls.get(index)
        if item is None:
            item = {"id": self._item_id("fc", len(self.output)), "type": "function_call", "status": "in_progress",
                    "call_id": self._item_id("call", len(self.output)), "name": name or "", "arguments": ""}
            self._calls[index] = item
            self.output.append(item)
            events.append({"type": "response.output_item.added", "output_index": len(self.output) - 1,
                           "item": dict(item)})
        if arguments:
            item["arguments"] += arguments
            events.append({"type": "response.function_call_arguments.delta", "item_id": item["id"],
                           "output_index": self.output.index(item), "delta": arguments})
        return events

    def _item_id(self, prefix: str, output_index: int) -> str:
        """Ids that the same response gets again when its events are rebuilt from its tokens
        (a gateway resuming it; store.py), so a resumed stream repeats none with another id."""
        digest = hashlib.sha256(f"{self.response_id}/{output_index}".encode()).hexdigest()[:24]
        return f"{prefix}_{digest}"

    def _close_items(self, status: str = "completed") -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for index, item in enumerate(self.output):
            if item["status"] != "in_progress":
                continue
            item["status"] = status
            if item["type"] == "message":
                part = item["content"][0]
                events += [{"type": "response.output_text.done", "item_id": item["id"], "output_index": index,
                            "content_index": 0, "text": part["text"], "logprobs": []},
                           {"type": "response.content_part.done", "item_id": item["id"], "output_index": index,
                            "content_index": 0, "part": dict(part)}]
            else:
                events.append({"type": "response.function_call_arguments.done", "item_id": item["id"],
                               "output_index": index, "name": item["name"], "arguments": item["arguments"]})
            events.append({"type": "response.output_item.done", "output_index": index,
                           "item": {**item, "content": [dict(p) for p in item["content"]]}
                           if item["type"] == "message" else dict(item)})
        self._message = None
        return events


def _usage(usage: Usage | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    return {"input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


def conversation_of(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output as chat messages, to continue it (previous_response_id)."""
    messages: list[dict[str, Any]] = []
    for item in output:
        if item["type"] == "message":
            messages.append({"role": "assistant", "content": "".join(p["text"] for p in item["content"])})
        elif item["type"] == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if messages and messages[-1].get("tool_calls"):
                messages[-1]["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    return messages
