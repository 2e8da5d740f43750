"""Detached requests (a background /v1/responses response) at the real gRPC
scheduler: the caller leaving does not cancel one; Attach replays it from its
first token and follows it; another client is told it does not exist."""

from __future__ import annotations

import grpc
import pytest
from fairserve.v1 import scheduler_pb2

from tests.unit.scheduler.fake_worker import reference_output
from tests.unit.scheduler.test_transport import PROMPT, _request, make_stack  # noqa: F401 (the fixture)


def _detached(request_id: str, client_id: str = "alice", max_tokens: int = 40) -> scheduler_pb2.GenerateRequest:
    return _request(request_id, max_tokens=max_tokens, client_id=client_id, authenticated=True, detached=True,
                    attachment=b'{"state": 1}')


async def test_a_detached_request_outlives_its_caller_and_is_replayed_whole(make_stack) -> None:
    stack = await make_stack()
    await stack.add_worker(step_delay_s=0.01)
    call = stack.stub.Generate(_detached("resp_1"), timeout=10)
    first = await anext(aiter(call))
    assert first.tokens
    call.cancel()                                       # the gateway died
    events = [e async for e in stack.stub.Attach(
        scheduler_pb2.AttachRequest(request_id="resp_1", client_id="alice"), timeout=10)]
    assert [t.token_id for e in events for t in e.tokens] == reference_output(PROMPT, 40)
    assert events[-1].finish.finish_reason == "length"
    sent = await stack.stub.GetDetached(scheduler_pb2.AttachRequest(request_id="resp_1", client_id="alice"),
                                        timeout=5)
    assert sent.attachment == b'{"state": 1}' and list(sent.prompt_token_ids) == list(PROMPT)


async def test_another_client_cannot_attach_to_or_read_a_detached_request(make_stack) -> None:
    stack = await make_stack()
    await stack.add_worker(step_delay_s=0.01)
    events = [e async for e in stack.stub.Generate(_detached("resp_2"), timeout=10)]
    assert events[-1].finish.finish_reason == "length"
    for client in ("mallory", ""):
        ask = scheduler_pb2.AttachRequest(request_id="resp_2", client_id=client)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await stack.stub.GetDetached(ask, timeout=5)
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            [e async for e in stack.stub.Attach(ask, timeout=5)]
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
        assert "state" not in (caught.value.details() or "")


async def test_an_ordinary_request_is_still_cancelled_when_its_caller_leaves(make_stack) -> None:
    stack = await make_stack()
    await stack.add_worker(step_delay_s=0.01)
    call = stack.stub.Generate(_request("plain", max_tokens=1000), timeout=10)
    await anext(aiter(call))
    call.cancel()
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        [e async for e in stack.stub.Attach(scheduler_pb2.AttachRequest(request_id="plain"), timeout=5)]
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
