"""The gateway's drain (SIGTERM): /ready is 503 and new generations get 503
with Retry-After while the streams in flight finish; /health stays 200."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import grpc
import httpx
import pytest

from common.transport.grpc_server import GrpcServer, insecure_channel
from common.shutdown import StopRequests
from fairserve.v1 import gateway_pb2, gateway_pb2_grpc
from services.gateway.drain import RETRY_AFTER_S, Drain
from services.gateway.errors import ApiError
from services.gateway.doors.grpc_api import SERVICE_NAME, TextGenerationServicer, add_to_server
from services.gateway.main import drain_then_exit
from tests.unit.gateway.fakes import FakeScheduler, ServerThread

STREAM = {"prompt": "Hi", "raw": True, "max_tokens": 30, "stream": True}
CHAT = {"model": "gemma-3-270m", "messages": [{"role": "user", "content": "Hi"}]}


def _data(lines: Any) -> list[dict[str, Any]]:
    return [json.loads(line[len("data:"):]) for line in lines if line.startswith("data:")]


def test_a_draining_gateway_refuses_new_generations_and_finishes_the_streams_in_flight(
        make_app: Callable[..., Any]) -> None:
    fake = FakeScheduler(reply_ids=[10, 11, 12] * 10, token_delay_s=0.02)
    app = make_app(fake)
    drain: Drain = app.state.gateway.drain
    with ServerThread(app) as server, httpx.Client(base_url=server.url, timeout=10) as http, \
            httpx.Client(base_url=server.url, timeout=10) as other:
        with http.stream("POST", "/generate", json=STREAM) as stream:
            lines = stream.iter_lines()
            first = next(line for line in lines if line.startswith("data:"))
            assert drain.in_flight == 1
            drain.begin()
            for path, body in (("/generate", STREAM), ("/v1/chat/completions", CHAT),
                               ("/v1/completions", {"model": "gemma-3-270m", "prompt": "Hi"})):
                refused = other.post(path, json=body)
                assert refused.status_code == 503, (path, refused.text)
                assert refused.headers["retry-after"] == str(RETRY_AFTER_S)
                assert refused.json()["error"]["type"] == "service_unavailable_error"
            ready = other.get("/ready")
            assert ready.status_code == 503 and "shutting down" in ready.json()["error"]["message"]
            assert other.get("/health").status_code == 200
            events = _data([first, *lines])
    assert len(fake.requests) == 1
    assert events[-1]["finish_reason"] == "length" and events[-1]["usage"]["completion_tokens"] == 30
    assert len(events) == 31 and drain.in_flight == 0


async def test_the_grpc_text_api_refuses_new_generations_while_draining(
        make_app: Callable[..., Any], fake: FakeScheduler) -> None:
    state = make_app(fake).state.gateway
    state.drain.begin()
    server = GrpcServer([(add_to_server, TextGenerationServicer(state))], [SERVICE_NAME], "127.0.0.1", 0)
    await server.start()
    try:
        async with insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = gateway_pb2_grpc.TextGenerationStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Generate(gateway_pb2.TextRequest(prompt="Hi"), timeout=5)
            with pytest.raises(grpc.aio.AioRpcError) as refused_stream:
                await anext(aiter(stub.GenerateStream(gateway_pb2.TextRequest(prompt="Hi"), timeout=5)))
    finally:
        await server.stop(0)
    for error in (refused.value, refused_stream.value):
        assert error.code() is grpc.StatusCode.UNAVAILABLE
        assert ("retry-after", str(RETRY_AFTER_S)) in tuple(error.trailing_metadata())
    assert fake.requests == [] and state.drain.in_flight == 0


async def test_wait_idle_ends_with_the_last_generation_at_the_timeout_or_when_interrupted() -> None:
    drain = Drain()
    assert await drain.wait_idle(0.01)
    with drain.track():
        assert not await drain.wait_idle(0.01)
        interrupted = asyncio.Event()
        interrupted.set()
        assert not await drain.wait_idle(10, interrupted)

    async def generation() -> None:
        with drain.generation():
            await asyncio.sleep(0.05)

    task = asyncio.create_task(generation())
    await asyncio.sleep(0)
    assert drain.in_flight == 1 and await drain.wait_idle(5)
    await task
    drain.begin()
    with pytest.raises(ApiError) as refused:
        with drain.generation():
            pass
    assert refused.value.status == 503 and drain.in_flight == 0


async def test_the_first_signal_drains_then_exits_and_a_second_exits_at_once() -> None:
    stops, drain = StopRequests(), Drain()
    server = SimpleNamespace(should_exit=False, force_exit=False)
    task = asyncio.create_task(drain_then_exit(stops, drain, server, timeout_s=5))  # type: ignore[arg-type]
    with drain.track():
        stops()
        await asyncio.sleep(0.05)
        assert drain.draining and not server.should_exit
    await asyncio.sleep(0.05)
    assert server.should_exit and not server.force_exit
    stops()
    await asyncio.wait_for(task, 1)
    assert server.force_exit


async def test_a_drain_that_times_out_exits_with_generations_still_in_flight() -> None:
    stops, drain = StopRequests(), Drain()
    server = SimpleNamespace(should_exit=False, force_exit=False)
    task = asyncio.create_task(drain_then_exit(stops, drain, server, timeout_s=0.05))  # type: ignore[arg-type]
    with drain.track():
        stops()
        await asyncio.sleep(0.3)
        assert server.should_exit and not server.force_exit and drain.in_flight == 1
    task.cancel()
