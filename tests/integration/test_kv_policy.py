"""Lossy KV policies through the real stack (tiny model, a pool of 32 blocks of 4 tokens):
a request for more tokens than the pool holds completes under kv_policy "sink" (its cache
stays within KV_BUDGET_TOKENS) while under "full" it is refused with the numbers; an endless
one is refused at once under every policy (MAX_TOKENS_LIMIT, by default the context)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from fairserve.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

from fairserve.launcher.stack import Stack
from tests.integration.conftest import start_stack

NEW_TOKENS = 300     # the pool holds 128 tokens


@pytest.fixture(scope="module")
def small_pool_stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = start_stack(tmp_path_factory.mktemp("kv-policy"), tiny_model_dir, extra_env={
        "KV_CACHE_NUM_BLOCKS": "32", "KV_BUDGET_TOKENS": "32", "KV_SINK_TOKENS": "4"})
    yield stack
    stack.stop()


def complete(stack: Stack, **fields) -> httpx.Response:
    body = {"prompt": "Once upon a time", "max_tokens": NEW_TOKENS, "ignore_eos": True, "temperature": 0, **fields}
    return httpx.post(f"{stack.url}/v1/completions", json=body, timeout=300)


def test_sink_runs_past_the_pool_and_full_is_refused(small_pool_stack: Stack) -> None:
    reply = complete(small_pool_stack, kv_policy="sink")
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["usage"]["completion_tokens"] == NEW_TOKENS
    assert body["choices"][0]["finish_reason"] == "length"

    refused = complete(small_pool_stack, kv_policy="full")
    assert refused.status_code == 400, refused.text
    assert "KV blocks" in refused.json()["error"]["message"]

    stats = httpx.get(f"{small_pool_stack.url}/stats", timeout=10).json()["scheduler"]
    assert all(worker["used_blocks"] == 0 for worker in stats["workers"])


def test_an_endless_lossy_generation_is_refused_at_once(small_pool_stack: Stack) -> None:
    """max_tokens 2^31-1 with ignore_eos under sink: a 400 naming the field and the limit
    (the model's context by default) at the gateway, and INVALID_ARGUMENT at the scheduler
    for a request that bypasses the gateway."""
    reply = complete(small_pool_stack, kv_policy="sink", max_tokens=2**31 - 1)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "max_tokens" and "MAX_TOKENS_LIMIT" in error["message"]
    chat = httpx.post(f"{small_pool_stack.url}/v1/chat/completions", timeout=30, json={
        "messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 2**31 - 1,
        "kv_policy": "window", "ignore_eos": True})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "max_completion_tokens"
    with grpc.insecure_channel(f"127.0.0.1:{small_pool_stack.ports.scheduler}") as channel:
        request = scheduler_pb2.GenerateRequest(
            request_id="endless", prompt_token_ids=[2, 10, 11], max_tokens=2**31 - 1, ignore_eos=True,
            kv_policy="sink", sampling=common_pb2.SamplingParams(temperature=0.0))
        with pytest.raises(grpc.RpcError) as raised:
            list(scheduler_pb2_grpc.SchedulerStub(channel).Generate(request, timeout=30))
    assert raised.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "max_tokens" in (raised.value.details() or "")
