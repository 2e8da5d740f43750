"""Sends one planned request to the gateway and records what happened: status,
time to first token, the arrival time of every streamed chunk, token usage."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

from loadsim.users import PlannedRequest

# Outcomes of one request.
OK = "ok"
DISCONNECTED = "disconnected"          # the simulated user hung up after the first token, on purpose
REJECTED = "rejected"                  # HTTP 429: the server's admission queue was full
HTTP_ERROR = "http_error"              # any other non-200 answer
STREAM_ERROR = "stream_error"          # an error event inside a 200 stream, or a stream cut short
TRANSPORT_ERROR = "transport_error"    # connection refused or reset, timeout


@dataclass
class RequestRecord:
    user: str
    user_class: str
    template: str
    started_s: float                   # since the run started
    outcome: str = OK
    status: int | None = None
    error: str = ""
    ttft_s: float | None = None        # first chunk with text, since the request was sent
    latency_s: float = 0.0             # until the stream ended
    chunk_times_s: list[float] = field(default_factory=list)  # every chunk with text, since the request was sent
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    text: str = ""                     # the streamed answer (a multi-turn benchmark sends it back)


class Transport(Protocol):
    async def send(self, request: PlannedRequest, started_s: float) -> RequestRecord: ...


def chunk_text(event: dict[str, Any]) -> str:
    """The text an OpenAI streaming chunk carries (chat delta or completion text)."""
    text = ""
    for choice in event.get("choices") or []:
        delta = choice.get("delta")
        piece = delta.get("content") if isinstance(delta, dict) else choice.get("text")
        if isinstance(piece, str):
            text += piece
    return text


def apply_usage(record: RequestRecord, usage: dict[str, Any]) -> None:
    record.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    record.completion_tokens = int(usage.get("completion_tokens") or 0)
    details = usage.get("prompt_tokens_details") or {}
    record.cached_tokens = int(details.get("cached_tokens") or 0)


def error_message(body: bytes) -> str:
    try:
        error = json.loads(body).get("error")
        if isinstance(error, dict):
            return str(error.get("message", ""))
    except (ValueError, AttributeError):
        pass
    return body[:200].decode("utf-8", "replace")


class HttpTransport:
    def __init__(self, base_url: str, api_key: str | None = None, timeout_s: float = 300.0,
                 clock: Callable[[], float] = time.perf_counter, client: httpx.AsyncClient | None = None) -> None:
        self._base_url = base_url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._clock = clock
        self._client = client or httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0),
                                                   limits=httpx.Limits(max_connections=None,
                                                                       max_keepalive_connections=64))

    async def close(self) -> None:
        await self._client.aclose()

    async def send(self, request: PlannedRequest, started_s: float) -> RequestRecord:
        record = RequestRecord(user=request.user, user_class=request.user_class, template=request.template,
                               started_s=started_s)
        sent = self._clock()
        try:
            async with self._client.stream("POST", self._base_url + request.path, json=request.body,
                                           headers=self._headers) as response:
                record.status = response.status_code
                if response.status_code != 200:
                    record.outcome = REJECTED if response.status_code == 429 else HTTP_ERROR
                    record.error = error_message(await response.aread())
                else:
                    await self._read_stream(response, request, record, sent)
        except httpx.HTTPError as error:
            record.outcome = TRANSPORT_ERROR
            record.error = f"{type(error).__name__}: {error}"
        except (ValueError, TypeError, AttributeError) as error:   # a chunk that is not what the API promises
            record.outcome = STREAM_ERROR
            record.error = f"malformed stream: {type(error).__name__}: {error}"
        record.latency_s = self._clock() - sent
        return record

    async def _read_stream(self, response: httpx.Response, request: PlannedRequest,
                           record: RequestRecord, sent: float) -> None:
        done = finished = False
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                done = True
                break
            try:
                event = json.loads(data)
            except ValueError:
                record.outcome = STREAM_ERROR
                record.error = f"not JSON: {data[:200]}"
                return
            if not isinstance(event, dict):
                continue
            if "error" in event:
                record.outcome = STREAM_ERROR
                record.error = str((event["error"] or {}).get("message", event["error"]))
                return
            if event.get("usage"):
                apply_usage(record, event["usage"])
            finished = finished or any(choice.get("finish_reason") for choice in event.get("choices") or [])
            piece = chunk_text(event)
            if piece:
                record.text += piece
                now = self._clock() - sent
                record.chunk_times_s.append(now)
                if record.ttft_s is None:
                    record.ttft_s = now
                    if request.disconnect_after_first_token:
                        record.outcome = DISCONNECTED
                        return
        if not (done or finished):    # some servers end a finished stream without [DONE]
            record.outcome = STREAM_ERROR
            record.error = "the stream ended without [DONE] or a finish_reason"
        elif not record.completion_tokens:
            record.completion_tokens = len(record.chunk_times_s)
