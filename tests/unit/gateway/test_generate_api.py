from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from services.gateway.requests.backend import InvalidGeneration, Overloaded, Unavailable
from services.gateway.text.chat_template import raw_prompt_ids, user_turn_ids
from services.gateway.tenancy.tenant_config import load_tenants
from services.gateway.tenancy.tenants import derived_name
from tests.unit.gateway.conftest import REPLY_TEXT
from tests.unit.gateway.fakes import FakeScheduler, ServerThread


def sse_events(body: str) -> list[dict[str, Any]]:
    return [json.loads(line[len("data: "):]) for line in body.splitlines() if line.startswith("data: ")]


async def post(client: httpx.AsyncClient, body: dict[str, Any], **kwargs: Any) -> httpx.Response:
    return await client.post("/generate", json=body, **kwargs)


def assert_error_shape(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    return error


async def test_non_stream_returns_text_finish_and_usage(client: httpx.AsyncClient,
                                                        fake: FakeScheduler, tokenizer: Any,
                                                        reply_ids: list[int]) -> None:
    fake.cached_tokens = 3
    response = await post(client, {"prompt": "Hi", "stream": False})
    assert response.status_code == 200
    prompt_ids = user_turn_ids(tokenizer, "Hi")
    assert response.json() == {
        "text": REPLY_TEXT, "finish_reason": "stop",
        "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(reply_ids),
                  "cached_tokens": 3}}
    sent = fake.requests[0]
    assert list(sent.spec.prompt_token_ids) == prompt_ids
    assert sent.spec.max_tokens == 128 and sent.spec.sampling.temperature == 0.0
    assert sent.spec.stop_token_ids == (tokenizer.convert_tokens_to_ids("<end_of_turn>"),)
    assert sent.spec.client_id == "anonymous"


async def test_stream_sends_one_event_per_token_then_finish(client: httpx.AsyncClient,
                                                            reply_ids: list[int]) -> None:
    response = await post(client, {"prompt": "Hi"})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_events(response.text)
    token_events, last = events[:-1], events[-1]
    assert [event["token_id"] for event in token_events] == reply_ids[:-1]  # EOS is not output
    assert all(set(event) == {"token", "token_id"} for event in token_events)
    assert "".join(event["token"] for event in events) == REPLY_TEXT
    assert not any("\ufffd" in event["token"] for event in events)
    assert last["finish_reason"] == "stop"
    assert last["usage"]["completion_tokens"] == len(reply_ids)


async def test_raw_prompt_is_sent_as_is(client: httpx.AsyncClient, fake: FakeScheduler,
                                        tokenizer: Any) -> None:
    response = await post(client, {"prompt": "The capital of France is", "raw": True,
                                   "stream": False, "max_tokens": 3})
    assert response.json()["finish_reason"] == "length"
    assert response.json()["usage"]["completion_tokens"] == 3
    sent = fake.requests[0].spec
    assert list(sent.prompt_token_ids) == raw_prompt_ids(tokenizer, "The capital of France is")
    assert sent.stop_token_ids == ()


async def test_sampling_fields_and_fairness_client_reach_the_scheduler(
        client: httpx.AsyncClient, fake: FakeScheduler) -> None:
    await post(client, {"prompt": "Hi", "stream": False, "temperature": 0.7, "top_p": 0.9,
                        "top_k": 40, "seed": 7, "session_id": "s-1", "priority": 2})
    sent = fake.requests[0]
    assert (sent.spec.sampling.temperature, sent.spec.sampling.top_p, sent.spec.sampling.top_k,
            sent.spec.sampling.seed) == (pytest.approx(0.7), pytest.approx(0.9), 40, 7)
    assert (sent.spec.client_id, sent.spec.session_id, sent.spec.priority) == ("s-1", "s-1", 2)


async def test_stop_string_cuts_the_text_and_cancels(client: httpx.AsyncClient,
                                                     fake: FakeScheduler) -> None:
    response = await post(client, {"prompt": "Hi", "stream": False, "stop": ["東"]})
    body = response.json()
    assert body["text"] == "Paris is " and body["finish_reason"] == "stop"
    assert fake.cancelled == [fake.requests[0].request_id]
    assert body["usage"]["completion_tokens"] < len(fake.reply_for(fake.requests[0]))


async def test_stop_string_split_across_tokens_never_streams(client: httpx.AsyncClient) -> None:
    response = await post(client, {"prompt": "Hi", "stop": "is 東"})
    events = sse_events(response.text)
    assert "".join(event["token"] for event in events) == "Paris "
    assert events[-1]["finish_reason"] == "stop"


async def test_request_id_is_echoed_and_sent_to_the_scheduler(client: httpx.AsyncClient,
                                                              fake: FakeScheduler) -> None:
    response = await post(client, {"prompt": "Hi", "stream": False},
                          headers={"X-Request-ID": "abc-123"})
    assert response.headers["x-request-id"] == "abc-123"
    assert fake.requests[0].trace_id == "abc-123"
    assert fake.requests[0].request_id.startswith("abc-123.")
    generated = (await client.get("/health")).headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", generated)
    # An invalid id (too long, odd characters) is ignored and replaced (request_ids.py).
    for bad in ("A" * 129, "a b", "a/b", "é"):
        replaced = await post(client, {"prompt": "Hi", "stream": False},
                              headers={"X-Request-ID": bad.encode("latin-1")})
        assert re.fullmatch(r"[0-9a-f]{32}", replaced.headers["x-request-id"])
        assert fake.requests[-1].trace_id == replaced.headers["x-request-id"]


async def test_curl_form_content_type_is_read_as_json(client: httpx.AsyncClient) -> None:
    response = await client.post("/generate", content=b'{"prompt":"Hi","stream":false}',
                                 headers={"content-type": "application/x-www-form-urlencoded"})
    assert response.status_code == 200 and response.json()["text"] == REPLY_TEXT


@pytest.mark.parametrize(("body", "param", "numbers"), [
    ({"prompt": ""}, "prompt", []),
    ({"prompt": "x", "max_tokens": -1}, "max_tokens", ["-1"]),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", ["0"]),
    ({"prompt": "x", "temperature": 3}, "temperature", ["3"]),
    ({"prompt": "x", "top_p": 0}, "top_p", ["0"]),
    ({"prompt": "x", "top_k": -5}, "top_k", ["-5"]),
    ({"prompt": "x", "priority": 2**40}, "priority", []),
    ({"prompt": "x", "seed": 2**70}, "seed", []),
    ({"prompt": "x", "max_tokens": 500}, "max_tokens", ["512", "500"]),
    ({"prompt": "x", "stop": ["s"] * 50}, "stop", ["50"]),
])
async def test_bad_values_are_400_with_numbers(client: httpx.AsyncClient, body: dict[str, Any],
                                               param: str, numbers: list[str]) -> None:
    error = assert_error_shape(await post(client, body), 400)
    assert error["param"] == param and error["type"] == "invalid_request_error"
    for number in numbers:
        assert number in error["message"]


async def test_prompt_longer_than_the_context_is_400(make_app: Callable[..., Any],
                                                     fake: FakeScheduler) -> None:
    fake.model_len = 16
    transport = httpx.ASGITransport(app=make_app(fake))
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
        error = assert_error_shape(await post(http, {"prompt": "word " * 40}), 400)
    assert error["code"] == "context_length_exceeded" and "16" in error["message"]
    assert fake.requests == []


async def test_default_max_tokens_shrinks_to_the_room_left(make_app: Callable[..., Any],
                                                          fake: FakeScheduler, tokenizer: Any) -> None:
    fake.model_len = 40
    transport = httpx.ASGITransport(app=make_app(fake))
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
        await post(http, {"prompt": "Hi", "stream": False})
    assert fake.requests[0].spec.max_tokens == 40 - len(user_turn_ids(tokenizer, "Hi"))


@pytest.mark.parametrize("body", [{"prompt": "x", "max_tokens": "many"}, {"max_tokens": 3},
                                  {"prompt": ["a", "list"]}, [1, 2]])
async def test_schema_errors_are_422(client: httpx.AsyncClient, body: Any) -> None:
    error = assert_error_shape(await client.post("/generate", json=body), 422)
    assert error["code"] == "validation_error"


async def test_invalid_json_is_400(client: httpx.AsyncClient) -> None:
    response = await client.post("/generate", content=b'{"prompt": ',
                                 headers={"content-type": "application/json"})
    assert assert_error_shape(response, 400)["code"] == "invalid_json"


async def test_unknown_route_and_wrong_method(client: httpx.AsyncClient) -> None:
    assert_error_shape(await client.get("/nope"), 404)
    assert assert_error_shape(await client.get("/generate"), 405)["code"] == "method_not_allowed"


async def test_body_over_the_limit_is_413(make_app: Callable[..., Any], fake: FakeScheduler) -> None:
    app = make_app(fake, max_request_bytes=2048)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
        declared = await post(http, {"prompt": "x" * 5000})
        assert_error_shape(declared, 413)

        async def chunked() -> AsyncIterator[bytes]:
            yield b'{"prompt": "'
            for _ in range(10):
                yield b"y" * 1000
            yield b'"}'

        streamed = await http.post("/generate", content=chunked(),
                                   headers={"content-type": "application/json"})
        assert "content-length" not in streamed.request.headers
        assert assert_error_shape(streamed, 413)["code"] == "request_too_large"
        assert (await post(http, {"prompt": "small", "stream": False})).status_code == 200
    assert len(fake.requests) == 1


async def test_api_keys_are_required_when_set(make_app: Callable[..., Any],
                                              fake: FakeScheduler) -> None:
    transport = httpx.ASGITransport(app=make_app(fake, tenants=load_tenants("k1,k2")))
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
        body = {"prompt": "Hi", "stream": False}
        assert assert_error_shape(await post(http, body), 401)["code"] == "invalid_api_key"
        assert_error_shape(await post(http, body, headers={"Authorization": "Bearer bad"}), 401)
        ok = await post(http, body, headers={"Authorization": "Bearer k2"})
        assert ok.status_code == 200
        assert (await http.get("/health")).status_code == 200
    assert fake.requests[0].spec.client_id == derived_name(b"k2")  # the tenant, never the key


@pytest.mark.parametrize("stream", [True, False])
async def test_scheduler_rejections_map_to_statuses(client: httpx.AsyncClient,
                                                    fake: FakeScheduler, stream: bool) -> None:
    fake.reject = Overloaded("queue full: 64 waiting", retry_after_s=3)
    busy = await post(client, {"prompt": "Hi", "stream": stream})
    assert assert_error_shape(busy, 429)["type"] == "rate_limit_error"
    assert busy.headers["retry-after"] == "3"
    fake.reject = Unavailable("no worker")
    assert "no worker" in assert_error_shape(await post(client, {"prompt": "Hi", "stream": stream}),
                                             503)["message"]
    fake.reject = InvalidGeneration("needs 9000 KV tokens, pool has 4096")
    assert "9000" in assert_error_shape(await post(client, {"prompt": "Hi", "stream": stream}),
                                        400)["message"]
    await asyncio.sleep(0.05)
    assert fake.cancelled == []  # refused requests need no cancel


async def test_generation_error_is_500_or_an_error_event(client: httpx.AsyncClient,
                                                         fake: FakeScheduler,
                                                         reply_ids: list[int]) -> None:
    fake.reply_ids = reply_ids[:-1]  # no EOS: the fake then ends with the error
    fake.finish_error = "worker crashed"
    assert_error_shape(await post(client, {"prompt": "Hi", "stream": False}), 500)
    events = sse_events((await post(client, {"prompt": "Hi"})).text)
    assert events[-1]["error"]["message"] == "worker crashed"


async def test_health_ready_stats_and_metrics(client: httpx.AsyncClient, fake: FakeScheduler) -> None:
    assert (await client.get("/health")).json() == {"status": "ok", "degraded": []}
    assert (await client.get("/ready")).status_code == 200
    fake.kvcache_serving = False     # the index is a routing hint: ready still, and degraded
    assert (await client.get("/ready")).status_code == 200
    assert (await client.get("/health")).json() == {"status": "ok", "degraded": ["kvcache"]}
    fake.healthy_workers = 0
    assert "worker" in assert_error_shape(await client.get("/ready"), 503)["message"]
    stats = (await client.get("/stats")).json()
    assert set(stats) == {"ts", "gateway", "scheduler", "kvcache", "dependencies"}
    assert stats["dependencies"] == {"scheduler": True, "kvcache": False}
    await post(client, {"prompt": "Hi", "stream": False})
    metrics = (await client.get("/metrics")).text
    assert 'fairserve_gateway_dependency_up{dependency="kvcache"} 0.0' in metrics
    assert 'fairserve_gateway_dependency_up{dependency="scheduler"} 1.0' in metrics
    assert 'fairserve_gateway_http_requests_total{code="200",method="POST",route="/generate"} 1.0' in metrics
    assert "fairserve_gateway_ttft_seconds_bucket" in metrics
    assert "fairserve_gateway_e2e_latency_seconds_count 1.0" in metrics


async def test_client_disconnect_cancels_the_scheduler_stream(make_app: Callable[..., Any],
                                                              reply_ids: list[int]) -> None:
    fake = FakeScheduler(reply_ids=reply_ids[:-1] * 50, token_delay_s=0.02)
    with ServerThread(make_app(fake)) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as http:
            async with http.stream("POST", "/generate",
                                   json={"prompt": "Hi", "max_tokens": 400}) as response:
                assert response.status_code == 200
                lines = response.aiter_lines()
                while not (await anext(lines)).startswith("data: "):
                    pass
        request_id = fake.requests[0].request_id
        for _ in range(200):
            if request_id in fake.abandoned and request_id in fake.cancelled:
                break
            await asyncio.sleep(0.02)
    assert request_id in fake.abandoned
    assert request_id in fake.cancelled
    assert request_id not in fake.finished


async def test_client_leaving_a_non_stream_request_cancels_it(make_app: Callable[..., Any],
                                                              reply_ids: list[int]) -> None:
    fake = FakeScheduler(reply_ids=reply_ids[:-1] * 50, token_delay_s=0.02)
    with ServerThread(make_app(fake)) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=0.3) as http:
            with pytest.raises(httpx.ReadTimeout):
                await post(http, {"prompt": "Hi", "max_tokens": 400, "stream": False})
        for _ in range(200):
            if fake.abandoned and fake.cancelled:
                break
            await asyncio.sleep(0.02)
    assert fake.abandoned == [fake.requests[0].request_id]
    assert fake.cancelled == [fake.requests[0].request_id]


async def test_client_leaving_before_the_first_token_cancels(make_app: Callable[..., Any],
                                                             reply_ids: list[int]) -> None:
    fake = FakeScheduler(reply_ids=reply_ids[:-1], token_delay_s=2.0)  # a long queue wait
    with ServerThread(make_app(fake)) as server:
        async with httpx.AsyncClient(base_url=server.url, timeout=0.3) as http:
            with pytest.raises(httpx.ReadTimeout):
                await post(http, {"prompt": "Hi", "max_tokens": 5})
        for _ in range(100):
            if fake.abandoned and fake.cancelled:
                break
            await asyncio.sleep(0.02)
    assert fake.abandoned == [fake.requests[0].request_id]
    assert fake.cancelled == [fake.requests[0].request_id]


async def test_openapi_schema_lists_every_route(client: httpx.AsyncClient) -> None:
    schema = (await client.get("/openapi.json")).json()
    assert {"/generate", "/health", "/ready", "/metrics", "/stats", "/v1/models",
            "/v1/completions", "/v1/chat/completions"} <= set(schema["paths"])


async def test_max_model_len_setting_overrides_the_workers(make_app: Callable[..., Any],
                                                          fake: FakeScheduler) -> None:
    transport = httpx.ASGITransport(app=make_app(fake, max_model_len=10))
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
        error = assert_error_shape(await post(http, {"prompt": "Hi there, how are you"}), 400)
    assert "maximum context length is 10 tokens" in error["message"]
