"""The gateway's gRPC text API over a real gRPC channel, with a fake scheduler."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest

from common.transport.grpc_server import GrpcServer, insecure_channel
from fairserve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.gateway.requests.backend import Overloaded
from services.gateway.text.chat_template import raw_prompt_ids
from services.gateway.tenancy.tenant_config import load_tenants
from services.gateway.doors.grpc_api import (
    SERVICE_NAME,
    TextGenerationServicer,
    add_to_server,
    public_grpc_limits,
)
from services.gateway.settings import GatewaySettings
from tests.unit.gateway.conftest import REPLY_TEXT
from tests.unit.gateway.fakes import FakeScheduler


@pytest.fixture
async def text_api(make_app: Callable[..., Any], fake: FakeScheduler
                   ) -> AsyncIterator[Callable[..., Any]]:
    servers: list[GrpcServer] = []
    channels: list[grpc.aio.Channel] = []

    async def start(**settings: Any) -> gateway_pb2_grpc.TextGenerationStub:
        state = make_app(fake, **settings).state.gateway
        server = GrpcServer([(add_to_server, TextGenerationServicer(state))], [SERVICE_NAME],
                            "127.0.0.1", 0, **public_grpc_limits(GatewaySettings(**settings)))
        await server.start()
        servers.append(server)
        channel = insecure_channel(f"127.0.0.1:{server.port}")
        channels.append(channel)
        return gateway_pb2_grpc.TextGenerationStub(channel)

    yield start
    for channel in channels:
        await channel.close()
    for server in servers:
        await server.stop(0)


async def test_unary_generate(text_api: Callable[..., Any], fake: FakeScheduler,
                              reply_ids: list[int]) -> None:
    stub = await text_api()
    reply = await stub.Generate(gateway_pb2.TextRequest(prompt="Hi", user="bob"),
                                metadata=(("x-request-id", "grpc-1"),))
    assert reply.text == REPLY_TEXT and reply.finish_reason == "stop"
    assert reply.usage.completion_tokens == len(reply_ids)
    sent = fake.requests[0]
    assert sent.spec.client_id == "bob" and sent.trace_id == "grpc-1"
    assert sent.spec.sampling.temperature == 0.0 and sent.spec.max_tokens == 128


async def test_stream_raw_with_stop(text_api: Callable[..., Any], fake: FakeScheduler,
                                    tokenizer: Any) -> None:
    stub = await text_api()
    request = gateway_pb2.TextRequest(prompt="The capital", raw=True, stop=["東"], max_tokens=50,
                                      sampling=common_pb2.SamplingParams(temperature=0.5, seed=3))
    chunks = [chunk async for chunk in stub.GenerateStream(request)]
    assert "".join(chunk.text for chunk in chunks) == "Paris is "
    assert chunks[-1].finish_reason == "stop" and chunks[-1].usage.prompt_tokens > 0
    assert all(chunk.token_ids for chunk in chunks[:-1])
    sent = fake.requests[0]
    assert list(sent.spec.prompt_token_ids) == raw_prompt_ids(tokenizer, "The capital")
    assert sent.spec.sampling.seed == 3 and sent.spec.max_tokens == 50
    assert fake.cancelled == [sent.request_id]


async def test_errors_become_grpc_statuses(text_api: Callable[..., Any], fake: FakeScheduler) -> None:
    stub = await text_api()
    with pytest.raises(grpc.aio.AioRpcError) as bad:
        await stub.Generate(gateway_pb2.TextRequest(
            prompt="Hi", sampling=common_pb2.SamplingParams(temperature=9)))
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "temperature" in bad.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as empty:
        await stub.Generate(gateway_pb2.TextRequest(prompt=""))
    assert empty.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    fake.reject = Overloaded("queue full", retry_after_s=4)
    with pytest.raises(grpc.aio.AioRpcError) as busy:
        async for _chunk in stub.GenerateStream(gateway_pb2.TextRequest(prompt="Hi")):
            pass
    assert busy.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert ("retry-after", "4") in tuple(busy.value.trailing_metadata())


async def test_api_keys_apply_to_grpc(text_api: Callable[..., Any]) -> None:
    stub = await text_api(tenants=load_tenants("acme=k"))
    with pytest.raises(grpc.aio.AioRpcError) as denied:
        await stub.Generate(gateway_pb2.TextRequest(prompt="Hi"))
    assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
    reply = await stub.Generate(gateway_pb2.TextRequest(prompt="Hi"),
                                metadata=(("authorization", "Bearer k"),))
    assert reply.text == REPLY_TEXT


async def test_kv_policy_reaches_the_scheduler_and_an_unknown_one_is_invalid(
        text_api: Callable[..., Any], fake: FakeScheduler) -> None:
    stub = await text_api()
    await stub.Generate(gateway_pb2.TextRequest(prompt="Hi", kv_policy="sink"))
    assert fake.requests[-1].spec.kv_policy == "sink"
    await stub.Generate(gateway_pb2.TextRequest(prompt="Hi"))
    assert fake.requests[-1].spec.kv_policy == ""
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.Generate(gateway_pb2.TextRequest(prompt="Hi", kv_policy="lru"))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "kv_policy" in refused.value.details()


async def test_an_endless_lossy_generation_is_invalid_naming_max_tokens(
        text_api: Callable[..., Any], fake: FakeScheduler) -> None:
    stub = await text_api()
    asked = len(fake.requests)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.Generate(gateway_pb2.TextRequest(prompt="Hi", kv_policy="sink", max_tokens=2**31 - 1,
                                                    ignore_eos=True))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "max_tokens" in refused.value.details() and str(fake.model_len) in refused.value.details()
    assert len(fake.requests) == asked
async def test_an_invalid_request_id_is_replaced_and_never_logged(
        text_api: Callable[..., Any], fake: FakeScheduler, caplog: pytest.LogCaptureFixture) -> None:
    stub = await text_api()
    long_id = "A" * 3006
    caplog.set_level("DEBUG")
    for bad in (long_id, "id with spaces", "id/../x;rm", ""):
        await stub.Generate(gateway_pb2.TextRequest(prompt="Hi"), metadata=(("x-request-id", bad),))
    for sent in fake.requests:
        assert len(sent.trace_id) == 32 and sent.trace_id.isalnum()    # a fresh uuid4 hex
        assert len(sent.request_id) < 64
    assert "AAAAAAAAAA" not in caplog.text
    await stub.Generate(gateway_pb2.TextRequest(prompt="Hi"),
                        metadata=(("x-request-id", "a" * 128),))
    assert fake.requests[-1].trace_id == "a" * 128


async def test_calls_at_once_are_capped(text_api: Callable[..., Any], fake: FakeScheduler) -> None:
    fake.token_delay_s = 0.1
    stub = await text_api(grpc_max_concurrent_rpcs=1)
    slow = stub.GenerateStream(gateway_pb2.TextRequest(prompt="Hi", max_tokens=20))
    await slow.read()     # the first call is in flight
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.Generate(gateway_pb2.TextRequest(prompt="Hi", max_tokens=1))
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    slow.cancel()


def test_public_grpc_limits_from_settings() -> None:
    settings = GatewaySettings.from_env({
        "GATEWAY_GRPC_MAX_CONNECTIONS": "7", "GATEWAY_GRPC_MAX_STREAMS_PER_CONNECTION": "3",
        "GATEWAY_GRPC_MAX_CONCURRENT_RPCS": "9", "GATEWAY_HEADER_TIMEOUT_S": "2"})
    limits = public_grpc_limits(settings)
    options = dict(limits["options"])
    assert limits["max_concurrent_rpcs"] == 9
    assert options["grpc.max_allowed_incoming_connections"] == 7
    assert options["grpc.max_concurrent_streams"] == 3
    assert options["grpc.server_handshake_timeout_ms"] == 2000
    defaults = GatewaySettings.from_env({})
    assert (defaults.grpc_max_connections, defaults.grpc_max_streams_per_connection,
            defaults.grpc_max_concurrent_rpcs) == (1024, 100, 1024)
    for name in ("GATEWAY_GRPC_MAX_CONNECTIONS", "GATEWAY_GRPC_MAX_STREAMS_PER_CONNECTION",
                 "GATEWAY_GRPC_MAX_CONCURRENT_RPCS"):
        with pytest.raises(Exception, match=name):
            GatewaySettings.from_env({name: "0"})


async def test_model_names_a_served_name_or_an_adapter_else_not_found(
        text_api: Callable[..., Any], fake: FakeScheduler, tmp_path: Any) -> None:
    """`model` as over HTTP: served names and "" are the base, an allowed adapter is served, and
    bob probing alice's adapter gets exactly what a name that does not exist gets."""
    import json

    from tests.unit.gateway.test_lora_api import write_adapter
    tenants_file = tmp_path / "tenants.json"
    tenants_file.write_text(json.dumps({"tenants": {"alice": {"lora_adapters": ["secret-ft"]}}}))
    stub = await text_api(served_model_names=("my-model", "alias"),
                          tenants=load_tenants("alice=sk-a,bob=sk-b", str(tenants_file)),
                          lora_modules={"secret-ft": str(write_adapter(tmp_path / "secret-ft"))})
    alice, bob = (("authorization", "Bearer sk-a"),), (("authorization", "Bearer sk-b"),)
    for model in ("my-model", "alias", ""):
        await stub.Generate(gateway_pb2.TextRequest(prompt="Hi", max_tokens=1, model=model), metadata=bob)
    await stub.Generate(gateway_pb2.TextRequest(prompt="Hi", max_tokens=1, model="secret-ft"), metadata=alice)
    assert [sent.spec.lora_name for sent in fake.requests] == ["", "", "", "secret-ft"]
    refusals = []
    for model in ("secret-ft", "secret-fu"):
        request = gateway_pb2.TextRequest(prompt="Hi", model=model)
        with pytest.raises(grpc.aio.AioRpcError) as unary:
            await stub.Generate(request, metadata=bob)
        with pytest.raises(grpc.aio.AioRpcError) as streamed:
            await stub.GenerateStream(request, metadata=bob).read()
        for refused in (unary, streamed):
            assert refused.value.code() == grpc.StatusCode.NOT_FOUND
            refusals.append(refused.value.details().replace(model, "NAME"))
    assert refusals == ["The model `NAME` does not exist."] * 4 and len(fake.requests) == 4
