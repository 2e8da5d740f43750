"""One tenant floods past its limits (in flight, queued, rate) and gets 429
with Retry-After, over HTTP and gRPC, while another tenant's requests still
succeed; once the flood drains, the flooder is served again."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import httpx

from common.transport.grpc_server import GrpcServer, insecure_channel
from fairserve.v1 import gateway_pb2, gateway_pb2_grpc
from services.gateway.requests.backend import GenerationEvent, GenerationSpec
from services.gateway.doors.grpc_api import SERVICE_NAME, TextGenerationServicer, add_to_server
from services.gateway.tenancy.tenant_config import load_tenants
from tests.unit.gateway.fakes import FakeScheduler

KEYS = "queue-a=k-queue,flight-a=k-flight,rate-a=k-rate,b=k-b"
LIMITS = {"queue-a": {"max_queued": 2},
          "flight-a": {"max_in_flight": 2},
          "rate-a": {"requests_per_s": 0.2, "burst": 3},
          "b": {"max_in_flight": 50}}
BODY = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}


@dataclass
class HeldScheduler(FakeScheduler):
    """Holds every request of the clients in `held` before its first token
    (queued), or, for those in `running`, after it, until `gate` opens."""
    held: set[str] = field(default_factory=set)
    running: set[str] = field(default_factory=set)
    gate: asyncio.Event = field(default_factory=asyncio.Event)
    waiting: list[str] = field(default_factory=list)

    async def generate(self, spec: GenerationSpec, request_id: str,
                       trace_id: str = "") -> AsyncIterator[GenerationEvent]:
        if spec.client_id in self.held:
            self.waiting.append(spec.client_id)
            await self.gate.wait()
        first = True
        async for event in super().generate(spec, request_id, trace_id):
            yield event
            if first and spec.client_id in self.running:
                first = False
                await self.gate.wait()


def tenants_path(tmp_path: Path) -> str:
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps({"tenants": LIMITS}))
    return str(path)


async def until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.01)


def assert_429(reply: httpx.Response, reason: str) -> None:
    assert reply.status_code == 429, reply.text
    error = reply.json()["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "tenant_quota_exceeded"
    assert reason in error["message"]
    assert int(reply.headers["retry-after"]) >= 1


async def test_a_flooding_tenant_is_refused_alone(make_app: Callable[..., Any], reply_ids: list[int],
                                                  tmp_path: Path) -> None:
    fake = HeldScheduler(reply_ids=reply_ids, held={"queue-a"}, running={"flight-a"})
    app = make_app(fake, tenants=load_tenants(KEYS, tenants_path(tmp_path)))
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway",
                                 timeout=30) as http:
        def post(key: str, stream: bool = False) -> Any:
            return http.post("/v1/chat/completions", json={**BODY, "stream": stream},
                             headers={"Authorization": f"Bearer {key}"})

        # queue-a: two wait for a first token that does not come; the third is refused.
        queued = [asyncio.create_task(post("k-queue", stream=True)) for _ in range(2)]
        # flight-a: two have their first token and run on; the third is refused.
        flying = [asyncio.create_task(post("k-flight", stream=True)) for _ in range(2)]
        await until(lambda: len(fake.waiting) == 2 and sum(
            request.spec.client_id == "flight-a" for request in fake.requests) == 2)
        assert_429(await post("k-queue"), "waiting for their first token")
        assert_429(await post("k-flight"), "in flight")
        # rate-a: a burst of 3, then refused with the wait (1 token / 0.2 per s = 5 s).
        for _ in range(3):
            assert (await post("k-rate")).status_code == 200
        refused = await post("k-rate")
        assert_429(refused, "rate")
        assert refused.headers["retry-after"] == "5"
        # Meanwhile b is served, many times over.
        replies = await asyncio.gather(*(post("k-b") for _ in range(10)))
        assert [reply.status_code for reply in replies] == [200] * 10

        fake.gate.set()
        for reply in await asyncio.gather(*queued, *flying):
            assert reply.status_code == 200 and reply.text.endswith("data: [DONE]\n\n")
        assert (await post("k-queue")).status_code == 200
        assert (await post("k-flight")).status_code == 200
    metrics = app.state.gateway.metrics.registry
    assert metrics.get_sample_value("fairserve_gateway_requests_total", {"status": "rejected"}) == 3


async def test_grpc_gets_the_same_limits(make_app: Callable[..., Any], reply_ids: list[int],
                                         tmp_path: Path) -> None:
    fake = HeldScheduler(reply_ids=reply_ids, running={"flight-a"})
    state = make_app(fake, tenants=load_tenants(KEYS, tenants_path(tmp_path))).state.gateway
    server = GrpcServer([(add_to_server, TextGenerationServicer(state))], [SERVICE_NAME],
                        "127.0.0.1", 0)
    await server.start()
    channel = insecure_channel(f"127.0.0.1:{server.port}")
    try:
        stub = gateway_pb2_grpc.TextGenerationStub(channel)

        def call(key: str) -> Any:
            return stub.Generate(gateway_pb2.TextRequest(prompt="Hi", max_tokens=3),
                                 metadata=(("authorization", f"Bearer {key}"),))

        running = [asyncio.ensure_future(call("k-flight")) for _ in range(2)]
        await until(lambda: sum(r.spec.client_id == "flight-a" for r in fake.requests) == 2)
        try:
            await call("k-flight")
            raise AssertionError("the third call was not refused")
        except grpc.aio.AioRpcError as error:
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert ("retry-after", "1") in tuple(error.trailing_metadata())
        assert (await call("k-b")).finish_reason
        fake.gate.set()
        assert all(reply.finish_reason for reply in await asyncio.gather(*running))
    finally:
        await channel.close()
        await server.stop(0)
