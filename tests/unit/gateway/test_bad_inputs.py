"""Inputs that used to give a 5xx or slip through: each is now a 4xx in the
one error shape (or, for NaN logprobs, valid JSON)."""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator
from typing import Any

import grpc
import httpx
import pytest

from common.transport.grpc_server import GrpcServer, insecure_channel
from common.types import TokenLogprob, TopLogprob
from fairserve.v1 import gateway_pb2
from services.gateway.requests.backend import GenerationSpec
from services.gateway.doors.grpc_api import SERVICE_NAME, TextGenerationServicer, add_to_server
from services.gateway.requests.unsupported import UNSUPPORTED
from tests.unit.gateway.fakes import FakeScheduler

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
COMPLETION = {"prompt": "Hi", "max_tokens": 2}
PATHS = {"/v1/chat/completions": CHAT, "/v1/completions": COMPLETION,
         "/generate": {"prompt": "Hi", "max_tokens": 2, "stream": False}}


def error_of(reply: httpx.Response, status: int = 400) -> dict[str, Any]:
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("field, value", [
    ("user", "\ud800"), ("session_id", "a\udfff"), ("user", "u" * 257), ("session_id", "s" * 300)])
async def test_bad_identity_strings(client: httpx.AsyncClient, path: str, field: str,
                                    value: str) -> None:
    body = json.dumps({**PATHS[path], field: value})  # lone surrogates as \\ud800 escapes
    reply = await client.post(path, content=body, headers={"content-type": "application/json"})
    assert error_of(reply)["param"] == field


async def test_a_chat_message_needs_content(client: httpx.AsyncClient, fake: FakeScheduler) -> None:
    for message in ({"role": "user"}, {"role": "user", "content": None}):
        reply = await client.post("/v1/chat/completions",
                                  json={"messages": [{"role": "system", "content": "Be brief."},
                                                     message]})
        error = error_of(reply)
        assert error["param"] == "messages.1.content" and error["code"] == "missing_content"
    ok = await client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": ""}, {"role": "user", "content": []}]})
    assert ok.status_code == 200, ok.text  # empty content is content
    assert len(fake.requests) == 1


UNSUPPORTED_VALUES: dict[str, Any] = {
    "tools": [{"type": "function"}],
    "tool_choice": "auto", "functions": [{"name": "f"}],
    "function_call": "auto", "parallel_tool_calls": False, "guided_decoding_backend": "xgrammar",
    "guided_whitespace_pattern": " ", "best_of": 2, "suffix": "end",
    "use_beam_search": True, "length_penalty": 2, "verbosity": "low", "skip_special_tokens": False,
}


CHAT_TOOL_FIELDS = {"tools", "tool_choice", "parallel_tool_calls"}   # chat implements them


@pytest.mark.parametrize("path, name", [
    (path, name) for path in sorted(PATHS) for name in sorted(UNSUPPORTED_VALUES)
    if not (path == "/v1/chat/completions" and name in CHAT_TOOL_FIELDS)])
async def test_unsupported_fields_are_named(client: httpx.AsyncClient, path: str, name: str) -> None:
    reply = await client.post(path, json={**PATHS[path], name: UNSUPPORTED_VALUES[name]})
    error = error_of(reply)
    assert error["param"] == name and error["code"] == "unsupported_parameter"
    assert name in error["message"]


async def test_chat_echo_is_named(client: httpx.AsyncClient) -> None:
    reply = await client.post("/v1/chat/completions", json={**CHAT, "echo": True})
    assert error_of(reply)["param"] == "echo"
    assert (await client.post("/v1/chat/completions", json={**CHAT, "echo": False})).status_code == 200


async def test_unsupported_fields_at_null_or_default_are_fine(client: httpx.AsyncClient) -> None:
    defaults = {"response_format": {"type": "text"}, "tools": [], "tool_choice": "none",
                "logit_bias": {}, "parallel_tool_calls": True, "guided_json": None,
                "best_of": 1, "length_penalty": 1, "stop_token_ids": [], "suffix": None,
                "store": True, "metadata": {"k": "v"}}  # (unknown and harmless: ignored)
    for path, body in PATHS.items():
        reply = await client.post(path, json={**body, **defaults})
        assert reply.status_code == 200, (path, reply.text)
    assert set(UNSUPPORTED) >= set(UNSUPPORTED_VALUES)
    assert (await client.post("/v1/completions", json={**COMPLETION, "best_of": True})
            ).status_code == 400


class NanScheduler(FakeScheduler):
    @staticmethod
    def _logprob(spec: GenerationSpec, token_id: int) -> TokenLogprob | None:
        if not spec.sampling.logprobs:
            return None
        top = (TopLogprob(token_id, math.nan), TopLogprob(7, -math.inf))
        return TokenLogprob(math.nan, top[:spec.sampling.top_logprobs])


@pytest.fixture
async def nan_client(make_app: Any, reply_ids: list[int]) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=make_app(NanScheduler(reply_ids=reply_ids)),
                                    raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
        yield http


def strict_json(text: str) -> Any:
    def refuse(name: str) -> None:
        raise ValueError(f"invalid JSON constant {name}")
    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("stream", [False, True])
async def test_nan_logprobs_are_null(nan_client: httpx.AsyncClient, stream: bool) -> None:
    chat = await nan_client.post("/v1/chat/completions", json={
        **CHAT, "logprobs": True, "top_logprobs": 2, "stream": stream})
    completion = await nan_client.post("/v1/completions", json={
        **COMPLETION, "logprobs": 2, "stream": stream})
    for reply in (chat, completion):
        assert reply.status_code == 200, reply.text
        payloads = ([line[6:] for line in reply.text.splitlines()
                     if line.startswith("data: {")] if stream else [reply.text])
        bodies = [strict_json(payload) for payload in payloads]
        assert any(choice.get("logprobs") for body in bodies for choice in body["choices"])
    if not stream:
        entry = chat.json()["choices"][0]["logprobs"]["content"][0]
        assert entry["logprob"] is None
        assert [top["logprob"] for top in entry["top_logprobs"]] == [None, None]
        assert completion.json()["choices"][0]["logprobs"]["token_logprobs"][0] is None


async def test_grpc_malformed_and_bad_identity_are_invalid_argument(
        make_app: Any, fake: FakeScheduler) -> None:
    state = make_app(fake).state.gateway
    server = GrpcServer([(add_to_server, TextGenerationServicer(state))], [SERVICE_NAME],
                        "127.0.0.1", 0)
    await server.start()
    channel = insecure_channel(f"127.0.0.1:{server.port}")
    try:
        for method in ("Generate", "GenerateStream"):
            path = f"/{SERVICE_NAME}/{method}"
            for payload in (b"\xff\xff\xff", b"\x0a\x05ab", b"\x0a\x02\xed\xa0",
                            gateway_pb2.TextRequest(prompt="Hi", user="u" * 300).SerializeToString()):
                call = (channel.unary_unary if method == "Generate" else channel.unary_stream)(
                    path, request_serializer=lambda raw: raw, response_deserializer=lambda raw: raw)
                with pytest.raises(grpc.aio.AioRpcError) as raised:
                    reply = call(payload, timeout=10)
                    if method == "Generate":
                        await reply
                    else:
                        [_ async for _ in reply]
                assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, raised.value
    finally:
        await channel.close()
        await server.stop(0)
    assert fake.requests == []


async def test_grpc_messages_over_the_limit_are_refused(make_app: Any, fake: FakeScheduler) -> None:
    state = make_app(fake).state.gateway
    server = GrpcServer([(add_to_server, TextGenerationServicer(state))], [SERVICE_NAME],
                        "127.0.0.1", 0, max_receive_bytes=state.settings.grpc_max_message_bytes)
    await server.start()
    channel = insecure_channel(f"127.0.0.1:{server.port}")
    try:
        call = channel.unary_unary(f"/{SERVICE_NAME}/Generate",
                                   request_serializer=gateway_pb2.TextRequest.SerializeToString,
                                   response_deserializer=gateway_pb2.TextResponse.FromString)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await call(gateway_pb2.TextRequest(prompt="x" * (4 * 1024 * 1024 + 1)), timeout=10)
        assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert (await call(gateway_pb2.TextRequest(prompt="Hi", max_tokens=2), timeout=10)).text
    finally:
        await channel.close()
        await server.stop(0)
    assert len(fake.requests) == 1
