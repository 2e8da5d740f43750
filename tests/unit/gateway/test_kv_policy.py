"""kv_policy, fairserve's extra body field: sent to the scheduler as given, a 400 naming it
when unknown, and a lossy one is not held to the model's context."""

from __future__ import annotations


import httpx
import pytest

from tests.unit.gateway.fakes import FakeScheduler, ServerThread


def post(server: ServerThread, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=10)


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}),
    ("/generate", {"prompt": "Hello", "max_tokens": 2, "stream": False}),
])
def test_kv_policy_reaches_the_scheduler(server: ServerThread, fake: FakeScheduler, path: str, body: dict) -> None:
    reply = post(server, path, {**body, "kv_policy": "sink"})
    assert reply.status_code == 200, reply.text
    assert fake.requests[-1].spec.kv_policy == "sink"
    assert post(server, path, body).status_code == 200
    assert fake.requests[-1].spec.kv_policy == ""


def test_an_unknown_kv_policy_is_a_400_naming_it(server: ServerThread) -> None:
    reply = post(server, "/v1/completions", {"prompt": "Hello", "kv_policy": "lru"})
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "kv_policy"


def test_a_lossy_policy_may_ask_past_the_model_context(server: ServerThread, fake: FakeScheduler) -> None:
    too_long = fake.model_len + 10
    assert post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": too_long}).status_code == 400
    reply = post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": too_long, "kv_policy": "sink"})
    assert reply.status_code == 200, reply.text
    assert fake.requests[-1].spec.max_tokens == too_long


def test_under_a_lossy_deployment_default_a_request_naming_none_may_ask_past_the_context(
        server: ServerThread, fake: FakeScheduler) -> None:
    fake.default_kv_policy = "sink"     # the scheduler's KV_POLICY, as GetModelInfo reports it
    too_long = fake.model_len + 10
    reply = post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": too_long})
    assert reply.status_code == 200, reply.text
    assert fake.requests[-1].spec.kv_policy == "" and fake.requests[-1].spec.max_tokens == too_long
    # A request that asks for the full cache is still held to the model's context.
    assert post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": too_long,
                                            "kv_policy": "full"}).status_code == 400
