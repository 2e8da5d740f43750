"""Losing the scheduler mid-request: the gateway waits for it and resubmits the
request as a continuation, so every door's client sees the text it would have
seen undisturbed, with right usage; past SCHEDULER_RECOVERY_S it fails as it
did without recovery; refusals are never resubmitted."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from common.transport.grpc_server import GrpcServer, insecure_channel
from fairserve.v1 import gateway_pb2, gateway_pb2_grpc
from services.gateway.requests.backend import SchedulerLost, Unavailable
from services.gateway.doors.grpc_api import SERVICE_NAME, TextGenerationServicer, add_to_server
from tests.unit.gateway.conftest import REPLY_TEXT
from tests.unit.gateway.fakes import FakeScheduler


def sse_events(body: str) -> list[dict[str, Any]]:
    return [json.loads(line[len("data: "):]) for line in body.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


@pytest.fixture
def http_of(make_app: Callable[..., Any]) -> Callable[..., httpx.AsyncClient]:
    def make(fake: FakeScheduler, **settings: Any) -> httpx.AsyncClient:
        transport = httpx.ASGITransport(app=make_app(fake, **settings))
        return httpx.AsyncClient(transport=transport, base_url="http://gateway", timeout=10)
    return make


async def _stream(http: httpx.AsyncClient, body: dict[str, Any]) -> list[dict[str, Any]]:
    response = await http.post("/generate", json={"prompt": "Hi", **body})
    assert response.status_code == 200, response.text
    return sse_events(response.text)


async def test_a_stream_goes_on_across_two_losses_without_a_gap_or_a_repeat(
        http_of: Callable[..., httpx.AsyncClient], reply_ids: list[int]) -> None:
    async with http_of(FakeScheduler(reply_ids=reply_ids)) as http:
        calm = await _stream(http, {})
    fake = FakeScheduler(reply_ids=reply_ids, lose_after=[3, 2])
    async with http_of(fake) as http:
        events = await _stream(http, {})
    assert [e["token_id"] for e in events if "token_id" in e] == \
        [e["token_id"] for e in calm if "token_id" in e]
    assert "".join(e.get("token", "") for e in events) == REPLY_TEXT
    assert events[-1]["finish_reason"] == "stop" and events[-1]["usage"] == calm[-1]["usage"]
    assert events[-1]["usage"]["completion_tokens"] == len(reply_ids)
    # Lost after 3 tokens: refused twice while the scheduler restarts, then resumed
    # from those 3; lost again 2 tokens later, resumed from 5. Fresh ids each time.
    sent = fake.requests
    assert [len(r.spec.resume_token_ids) for r in sent] == [0, 3, 3, 3, 5, 5, 5]
    assert sent[3].spec.resume_token_ids == tuple(reply_ids[:3])
    assert [r.spec.resubmitted for r in sent] == [False] + [True] * 6
    assert len({r.request_id for r in sent}) == len(sent)
    assert all(r.spec.prompt_token_ids == sent[0].spec.prompt_token_ids for r in sent)
    assert all(r.spec.max_tokens == sent[0].spec.max_tokens for r in sent)
    assert {r.trace_id for r in sent} == {sent[0].trace_id}


async def test_non_streaming_and_n_choices_each_resume_their_own_tokens(
        http_of: Callable[..., httpx.AsyncClient], reply_ids: list[int]) -> None:
    fake = FakeScheduler(reply_ids=reply_ids, lose_after=[4], after_loss=[])
    async with http_of(fake) as http:
        plain = await http.post("/generate", json={"prompt": "Hi", "stream": False})
        assert plain.status_code == 200, plain.text
        assert plain.json()["text"] == REPLY_TEXT
        assert plain.json()["usage"]["completion_tokens"] == len(reply_ids)
        fake.requests.clear()
        fake.lose_after = [2, 5]
        reply = await http.post("/v1/completions", json={"model": "gemma-3-270m", "prompt": "Hi", "n": 2,
                                                         "temperature": 0, "max_tokens": 64})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert [choice["text"] for choice in body["choices"]] == [REPLY_TEXT, REPLY_TEXT]
    assert body["usage"]["completion_tokens"] == 2 * len(reply_ids)
    assert body["usage"]["prompt_tokens"] == len(fake.requests[0].spec.prompt_token_ids)  # one prompt
    resumed = sorted(len(r.spec.resume_token_ids) for r in fake.requests if r.spec.resume_token_ids)
    assert resumed == [2, 5]


async def test_a_request_lost_before_its_first_token_is_sent_again(
        http_of: Callable[..., httpx.AsyncClient], reply_ids: list[int]) -> None:
    fake = FakeScheduler(reply_ids=reply_ids, lose_after=[0])
    async with http_of(fake) as http:
        reply = await http.post("/generate", json={"prompt": "Hi", "stream": False})
    assert reply.status_code == 200 and reply.json()["text"] == REPLY_TEXT
    assert [r.spec.resume_token_ids for r in fake.requests] == [()] * 4
    # Sent again as it was, marked as admitted before: the scheduler neither refuses
    # nor charges it again against its tenant's limits.
    assert [r.spec.resubmitted for r in fake.requests] == [False, True, True, True]
    assert dataclasses.replace(fake.requests[-1].spec, resubmitted=False) == fake.requests[0].spec


async def test_past_the_recovery_time_the_error_is_what_it_was_without_recovery(
        http_of: Callable[..., httpx.AsyncClient], reply_ids: list[int]) -> None:
    fake = FakeScheduler(reply_ids=reply_ids, lose_after=[3], stay_down=True)
    async with http_of(fake, scheduler_recovery_s=0.3) as http:
        events = await _stream(http, {})
        assert len([e for e in events if "token_id" in e]) == 3
        assert "error" in events[-1] and "finish_reason" not in events[-1]
        refused = await http.post("/generate", json={"prompt": "Hi", "stream": False})
    assert refused.status_code == 503, refused.text
    assert len(fake.requests) > 3   # it did retry meanwhile
    fake = FakeScheduler(reply_ids=reply_ids, lose_after=[3])
    async with http_of(fake, scheduler_recovery_s=0) as http:
        events = await _stream(http, {})
    assert "error" in events[-1] and len(fake.requests) == 1   # 0: no recovery at all


async def test_a_gateway_that_never_reached_its_scheduler_fails_at_once(
        http_of: Callable[..., httpx.AsyncClient], reply_ids: list[int]) -> None:
    fake = FakeScheduler(reply_ids=reply_ids, lose_after=[0], scheduler_seen=False)
    async with http_of(fake) as http:
        reply = await http.post("/generate", json={"prompt": "Hi", "stream": False})
    assert reply.status_code == 503 and len(fake.requests) == 1


async def test_refusals_are_not_resubmitted(http_of: Callable[..., httpx.AsyncClient],
                                            reply_ids: list[int]) -> None:
    fake = FakeScheduler(reply_ids=reply_ids, reject=Unavailable("no worker is registered"))
    async with http_of(fake) as http:
        reply = await http.post("/generate", json={"prompt": "Hi", "stream": False})
    assert reply.status_code == 503 and len(fake.requests) == 1
    assert not isinstance(Unavailable("x"), SchedulerLost)


async def test_a_stop_string_after_a_resume_cancels_the_continuation(
        http_of: Callable[..., httpx.AsyncClient], reply_ids: list[int]) -> None:
    fake = FakeScheduler(reply_ids=reply_ids, lose_after=[1], after_loss=[])
    async with http_of(fake) as http:
        reply = await http.post("/generate", json={"prompt": "Hi", "stream": False, "stop": ["東"]})
    assert reply.json()["text"] == "Paris is " and reply.json()["finish_reason"] == "stop"
    assert fake.cancelled == [fake.requests[-1].request_id] != [fake.requests[0].request_id]


@pytest.fixture
async def text_api(make_app: Callable[..., Any]) -> AsyncIterator[Callable[..., Any]]:
    servers: list[GrpcServer] = []
    channels: list[Any] = []

    async def start(fake: FakeScheduler) -> gateway_pb2_grpc.TextGenerationStub:
        server = GrpcServer([(add_to_server, TextGenerationServicer(make_app(fake).state.gateway))],
                            [SERVICE_NAME], "127.0.0.1", 0)
        await server.start()
        servers.append(server)
        channels.append(insecure_channel(f"127.0.0.1:{server.port}"))
        return gateway_pb2_grpc.TextGenerationStub(channels[-1])

    yield start
    for channel in channels:
        await channel.close()
    for server in servers:
        await server.stop(0)


async def test_the_grpc_text_api_resumes_too(text_api: Callable[..., Any], reply_ids: list[int]) -> None:
    stub = await text_api(FakeScheduler(reply_ids=reply_ids, lose_after=[2, 0, 6]))
    chunks = [chunk async for chunk in stub.GenerateStream(gateway_pb2.TextRequest(prompt="Hi"))]
    assert "".join(chunk.text for chunk in chunks) == REPLY_TEXT
    assert [t for chunk in chunks for t in chunk.token_ids] == reply_ids[:-1]   # EOS is not text
    assert chunks[-1].usage.completion_tokens == len(reply_ids)
    stub = await text_api(FakeScheduler(reply_ids=reply_ids, lose_after=[5]))
    reply = await stub.Generate(gateway_pb2.TextRequest(prompt="Hi"))
    assert reply.text == REPLY_TEXT and reply.usage.completion_tokens == len(reply_ids)
