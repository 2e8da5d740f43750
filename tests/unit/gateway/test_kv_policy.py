"""kv_policy, fairserve's extra body field: sent to the scheduler as given, a 400 naming it
when unknown, and a lossy one is not held to the model's context but is held, like every
request, to MAX_TOKENS_LIMIT (by default the context length)."""

from __future__ import annotations


import httpx
import pytest

from collections.abc import Callable, Iterator
from typing import Any

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


@pytest.fixture
def roomy(make_app: Callable[..., Any], fake: FakeScheduler) -> Iterator[ServerThread]:
    """The gateway with MAX_TOKENS_LIMIT set past the model's context."""
    with ServerThread(make_app(fake, max_tokens_limit=4096)) as running:
        yield running


def test_a_lossy_policy_may_ask_past_the_model_context(roomy: ServerThread, fake: FakeScheduler) -> None:
    server = roomy
    too_long = fake.model_len + 10
    assert post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": too_long}).status_code == 400
    reply = post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": too_long, "kv_policy": "sink"})
    assert reply.status_code == 200, reply.text
    assert fake.requests[-1].spec.max_tokens == too_long


def test_under_a_lossy_deployment_default_a_request_naming_none_may_ask_past_the_context(
        roomy: ServerThread, fake: FakeScheduler) -> None:
    server = roomy
    fake.default_kv_policy = "sink"     # the scheduler's KV_POLICY, as GetModelInfo reports it
    too_long = fake.model_len + 10
    reply = post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": too_long})
    assert reply.status_code == 200, reply.text
    assert fake.requests[-1].spec.kv_policy == "" and fake.requests[-1].spec.max_tokens == too_long
    # A request that asks for the full cache is still held to the model's context.
    assert post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": too_long,
                                            "kv_policy": "full"}).status_code == 400


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "Hello"}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}]}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3},
     "max_completion_tokens"),
    ("/generate", {"prompt": "Hello", "stream": False}, "max_tokens"),
])
def test_an_endless_lossy_generation_is_a_400_naming_the_field_and_the_limit(
        server: ServerThread, fake: FakeScheduler, path: str, body: dict, param: str) -> None:
    asked = len(fake.requests)
    for policy in ({"kv_policy": "sink"}, {"kv_policy": "window"}, {"kv_policy": "h2o"}):
        reply = post(server, path, {**body, param: 2**31 - 1, "ignore_eos": True, **policy})
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["param"] == param and str(fake.model_len) in error["message"]
    assert len(fake.requests) == asked, "refused before anything was queued"


def test_under_a_lossy_deployment_default_the_limit_holds_too(server: ServerThread, fake: FakeScheduler) -> None:
    fake.default_kv_policy = "sink"
    reply = post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 2**31 - 1})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "max_tokens"
    assert post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": fake.model_len}).status_code == 200


def test_an_explicit_limit_applies_below_the_context_and_bounds_the_default(
        make_app: Callable[..., Any], fake: FakeScheduler) -> None:
    with ServerThread(make_app(fake, max_tokens_limit=8, default_max_tokens=128)) as server:
        reply = post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 9})
        assert reply.status_code == 400 and "at most 8" in reply.json()["error"]["message"]
        assert post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 8}).status_code == 200
        assert post(server, "/v1/completions", {"prompt": "Hello"}).status_code == 200
        assert fake.requests[-1].spec.max_tokens == 8
