"""The HTTP transport against scripted gateway answers (httpx.MockTransport)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable

import httpx
import pytest

from loadsim import transport as t
from loadsim.users import PlannedRequest


class TickClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 0.5
        return self.now


def sse(*events: object, done: bool = True) -> bytes:
    lines = [f"data: {json.dumps(e) if not isinstance(e, str) else e}\n\n" for e in events]
    return ("".join(lines) + ("data: [DONE]\n\n" if done else "")).encode()


def chat_chunk(text: str) -> dict:
    return {"choices": [{"index": 0, "delta": {"content": text}}]}


USAGE = {"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15,
                                  "prompt_tokens_details": {"cached_tokens": 8}}}


def request(disconnect: bool = False, path: str = "/v1/chat/completions") -> PlannedRequest:
    return PlannedRequest(user="u-0", user_class="u", template="tpl", path=path, body={"stream": True},
                          disconnect_after_first_token=disconnect)


async def send(handler: Callable[[httpx.Request], httpx.Response], planned: PlannedRequest) -> t.RequestRecord:
    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    transport = t.HttpTransport("http://gw/", api_key="k", clock=TickClock(), client=client)
    try:
        return await transport.send(planned, started_s=1.25)
    finally:
        await transport.close()


async def test_a_streamed_answer_is_timed_and_counted() -> None:
    seen: list[httpx.Request] = []

    def handler(req: httpx.Request) -> httpx.Response:
        seen.append(req)
        body = sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]},
                   chat_chunk("Hel"), chat_chunk("lo"), chat_chunk("!"), USAGE)
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    record = await send(handler, request())
    assert seen[0].url == "http://gw/v1/chat/completions"
    assert seen[0].headers["authorization"] == "Bearer k"
    assert record.outcome == t.OK and record.status == 200 and record.started_s == 1.25
    assert (record.prompt_tokens, record.completion_tokens, record.cached_tokens) == (12, 3, 8)
    assert len(record.chunk_times_s) == 3 and record.ttft_s == record.chunk_times_s[0]
    assert record.chunk_times_s == sorted(record.chunk_times_s) and record.latency_s > record.chunk_times_s[-1]


async def test_a_finished_stream_without_done_is_ok() -> None:
    body = sse(chat_chunk("a"), {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}],
                                 "usage": USAGE["usage"]}, done=False)
    record = await send(lambda req: httpx.Response(200, content=body), request())
    assert record.outcome == t.OK and record.completion_tokens == 3


async def test_completion_text_counts_chunks_without_usage() -> None:
    body = sse({"choices": [{"index": 0, "text": "a"}]}, {"choices": [{"index": 0, "text": "b"}]})
    record = await send(lambda req: httpx.Response(200, content=body), request(path="/v1/completions"))
    assert record.outcome == t.OK and record.completion_tokens == 2


@pytest.mark.parametrize("status, outcome", [(429, t.REJECTED), (400, t.HTTP_ERROR), (503, t.HTTP_ERROR)])
async def test_error_answers_are_classified_with_their_message(status: int, outcome: str) -> None:
    error = {"error": {"message": "queue is full", "type": "x"}}
    record = await send(lambda req: httpx.Response(status, json=error), request())
    assert (record.outcome, record.status, record.error) == (outcome, status, "queue is full")


@pytest.mark.parametrize("body, message", [
    (sse(chat_chunk("a"), {"error": {"message": "worker lost"}}), "worker lost"),
    (sse(chat_chunk("a"), done=False), "without [DONE]"),
    (sse("{broken"), "not JSON"),
    (sse({"choices": [], "usage": {"completion_tokens": "many"}}), "malformed stream"),
    (sse({"choices": "nope"}), "malformed stream"),
])
async def test_broken_streams_are_stream_errors(body: bytes, message: str) -> None:
    record = await send(lambda req: httpx.Response(200, content=body), request())
    assert record.outcome == t.STREAM_ERROR and message in record.error


async def test_a_disconnecting_user_stops_after_the_first_token() -> None:
    async def chunks() -> AsyncIterator[bytes]:
        yield sse(chat_chunk("first"), done=False)
        raise AssertionError("the transport read past the first token")

    record = await send(lambda req: httpx.Response(200, content=chunks()), request(disconnect=True))
    assert record.outcome == t.DISCONNECTED and record.ttft_s is not None


async def test_connection_failures_are_transport_errors() -> None:
    def refuse(req: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=req)

    record = await send(refuse, request())
    assert record.outcome == t.TRANSPORT_ERROR and "connection refused" in record.error
