"""Malformed and random bodies never produce a 5xx, with and without API
keys, and a well-formed request still completes afterwards; random and
malformed TextRequests on the gRPC text API never end in a server failure."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks.fuzz_grpc import SERVER_FAILURES, run_grpc_fuzz
from fairserve.v1 import common_pb2, gateway_pb2
from services.gateway.app import create_app
from services.gateway.settings import GatewaySettings
from services.gateway.tenancy.tenant_config import load_tenants
from tests.unit.gateway.fakes import FakeScheduler, GrpcThread

API_KEY = "sk-fuzz-key"
json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                         st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20))
json_values = st.recursive(json_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12)
FIELDS = ["prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
          "top_k", "min_p", "seed", "stop", "n", "stream", "stream_options", "logprobs",
          "top_logprobs", "priority", "session_id", "user", "raw", "min_tokens",
          "repetition_penalty", "ignore_eos", "presence_penalty", "frequency_penalty", "echo",
          "tools", "response_format", "logit_bias", "best_of", "guided_json"]
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "x"]),
                                 "content": st.one_of(st.text(max_size=30), json_values)})
bodies = st.one_of(
    json_values,
    st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=6),
    st.fixed_dictionaries({"prompt": st.text(max_size=40), "messages": st.lists(message, max_size=3)},
                          optional={name: json_scalars for name in FIELDS[2:]}),
)
PATHS = ["/generate", "/v1/completions", "/v1/chat/completions"]
# What a client may present: the key, nothing, a wrong key, bytes no key is made of.
AUTHS: list[dict[str, bytes]] = [
    {"authorization": f"Bearer {API_KEY}".encode()}, {"x-api-key": API_KEY.encode()}, {},
    {"authorization": b"Bearer wrong"}, {"authorization": b"Bearer \xff\xfe\x80"},
    {"x-api-key": b"\xc3\xa9" * 40}, {"authorization": b"Basic " + API_KEY.encode()}]


def _settings(keyed: bool) -> GatewaySettings:
    return GatewaySettings(tenants=load_tenants(f"fuzz={API_KEY}") if keyed else load_tenants(""))


@pytest.mark.parametrize("keyed", [False, True])
@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(PATHS), body=bodies, auth=st.sampled_from(range(len(AUTHS))))
def test_no_5xx_for_random_bodies(tokenizer: Any, keyed: bool, path: str, body: Any,
                                  auth: int) -> None:
    headers = {"content-type": b"application/json", **(AUTHS[auth] if keyed else {})}

    async def run() -> int:
        fake = FakeScheduler(reply_ids=[40, 41, 42])
        transport = httpx.ASGITransport(app=create_app(_settings(keyed), fake, tokenizer),
                                        raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
            response = await http.post(path, content=json.dumps(body).encode(), headers=headers)
            if response.status_code >= 400:
                assert set(response.json()["error"]) == {"message", "type", "param", "code"}
            return response.status_code

    status = asyncio.run(run())
    assert status < 500, (path, body)
    if keyed and auth > 1:
        assert status == 401, (path, body, AUTHS[auth])


@pytest.mark.parametrize("keyed", [False, True])
async def test_raw_garbage_bytes_are_4xx(tokenizer: Any, keyed: bool) -> None:
    fake = FakeScheduler(reply_ids=[40, 41, 42])
    transport = httpx.ASGITransport(app=create_app(_settings(keyed), fake, tokenizer),
                                    raise_app_exceptions=False)
    headers = {"authorization": f"Bearer {API_KEY}"}
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway",
                                 headers=headers) as http:
        for payload in [b"\xff\xfe\x00", b"{", b"null", b"[]", b'"text"', b"1e999999",
                        b'{"prompt": "\\ud800"}', b'{"prompt": 1}',
                        b'{"prompt": "a", "user": "\\udc00"}', b'{"prompt": "a", "tools": [1]}']:
            for path in PATHS:
                response = await http.post(path, content=payload)
                assert 400 <= response.status_code < 500, (path, payload, response.text)
        ok = await http.post("/generate", json={"prompt": "Hi", "stream": False, "raw": True})
        assert ok.status_code == 200


@pytest.fixture(scope="module")
def grpc_gateways(tokenizer: Any) -> Iterator[dict[bool, str]]:
    """The gRPC text API without and with API keys, for synchronous clients."""
    fake = FakeScheduler(reply_ids=[40, 41, 42])
    open_app = create_app(_settings(False), fake, tokenizer)
    keyed_app = create_app(_settings(True), fake, tokenizer)
    limit = GatewaySettings().grpc_max_message_bytes
    with GrpcThread(open_app.state.gateway, limit) as open_api, \
            GrpcThread(keyed_app.state.gateway, limit) as keyed_api:
        yield {False: open_api.target, True: keyed_api.target}


floats = st.floats(allow_nan=True, allow_infinity=True, width=32)
int32 = st.integers(-2**31, 2**31 - 1)
texts = st.text(st.characters(exclude_categories=["Cs"]), max_size=40)
sampling = st.builds(
    common_pb2.SamplingParams, temperature=floats, top_p=floats, top_k=int32, min_p=floats,
    repetition_penalty=floats, presence_penalty=floats, frequency_penalty=floats,
    seed=st.integers(0, 2**64 - 1), top_logprobs=int32, logprobs=st.booleans(),
    min_tokens=int32, stop_token_ids=st.lists(int32, max_size=3))
requests = st.builds(
    gateway_pb2.TextRequest, prompt=texts, max_tokens=st.one_of(st.integers(0, 4), int32),
    sampling=st.one_of(st.none(), sampling), stop=st.lists(texts, max_size=20), raw=st.booleans(),
    session_id=texts, priority=int32, user=st.one_of(texts, st.just("u" * 300)),
    ignore_eos=st.booleans(), min_tokens=int32)
payloads = st.one_of(requests.map(lambda request: request.SerializeToString()),
                     st.binary(max_size=64),
                     requests.map(lambda request: request.SerializeToString()[:-1]))


@pytest.mark.parametrize("keyed", [False, True])
@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(payload=payloads, stream=st.booleans(), auth=st.sampled_from(["key", "none", "wrong"]))
def test_grpc_random_requests_never_fail_the_server(grpc_gateways: dict[bool, str], keyed: bool,
                                                    payload: bytes, stream: bool,
                                                    auth: str) -> None:
    metadata = {"key": (("authorization", f"Bearer {API_KEY}"),), "none": (),
                "wrong": (("x-api-key", "wrong"),)}[auth]
    with grpc.insecure_channel(grpc_gateways[keyed]) as channel:
        method = "GenerateStream" if stream else "Generate"
        call = (channel.unary_stream if stream else channel.unary_unary)(
            f"/fairserve.v1.TextGeneration/{method}", request_serializer=lambda raw: raw,
            response_deserializer=lambda raw: raw)
        try:
            reply = call(payload, metadata=metadata, timeout=30)
            list(reply) if stream else reply
        except grpc.RpcError as error:
            code = error.code()  # type: ignore[attr-defined]
            assert code not in SERVER_FAILURES, (payload, error)
            if keyed and auth != "key":
                assert code == grpc.StatusCode.UNAUTHENTICATED
            return
    assert not keyed or auth == "key"


@pytest.mark.parametrize("keyed", [False, True])
def test_the_grpc_fuzz_mode_of_the_benchmark(grpc_gateways: dict[bool, str], keyed: bool) -> None:
    report = run_grpc_fuzz(grpc_gateways[keyed], requests=150, threads=2, seed=3,
                           api_key=API_KEY if keyed else "")
    assert report.ok, report.summary()
    assert report.codes["OK"] > 0 and report.codes["INVALID_ARGUMENT"] > 0
    assert report.codes["UNAUTHENTICATED"] > 0 if keyed else "UNAUTHENTICATED" not in report.codes
