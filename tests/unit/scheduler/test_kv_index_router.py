"""The scheduler's KV-index lookups: failures route without the index, and only an
unreachable index or repeated timeouts pause the lookups."""

from __future__ import annotations

import asyncio

import grpc
from fairserve.v1 import kvindex_pb2

from services.kvcache.client import KvIndexClient
from services.scheduler.kv_router import KV_MISSED_DEADLINES_BEFORE_PAUSE, KV_RETRY_AFTER_S, KvIndexRouter


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class ScriptedIndex:
    """A KvIndex stub whose Lookup fails with the queued codes, then answers."""

    def __init__(self) -> None:
        self.failures: list[grpc.StatusCode] = []
        self.calls = 0

    async def Lookup(self, request: kvindex_pb2.LookupRequest, timeout: float,
                     metadata: object = None) -> kvindex_pb2.LookupResponse:
        self.calls += 1
        if self.failures:
            code = self.failures.pop(0)
            raise grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), "scripted")
        return kvindex_pb2.LookupResponse(matches=[kvindex_pb2.WorkerMatch(
            worker_id="w0", matched_tokens=len(request.token_ids))])


def lookup(router: KvIndexRouter) -> dict[str, int]:
    return asyncio.run(router.cached_prefix_tokens([1, 2, 3, 4]))


def test_one_slow_lookup_does_not_pause_the_index() -> None:
    index, clock = ScriptedIndex(), FakeClock()
    router = KvIndexRouter("unused", clock, client=KvIndexClient(None, stub=index))
    index.failures = [grpc.StatusCode.DEADLINE_EXCEEDED]
    assert lookup(router) == {}
    assert lookup(router) == {"w0": 4}
    assert index.calls == 2


def test_repeated_timeouts_pause_the_index_then_it_is_asked_again() -> None:
    index, clock = ScriptedIndex(), FakeClock()
    router = KvIndexRouter("unused", clock, client=KvIndexClient(None, stub=index))
    index.failures = [grpc.StatusCode.DEADLINE_EXCEEDED] * KV_MISSED_DEADLINES_BEFORE_PAUSE
    for _ in range(KV_MISSED_DEADLINES_BEFORE_PAUSE):
        assert lookup(router) == {}
    assert lookup(router) == {} and index.calls == KV_MISSED_DEADLINES_BEFORE_PAUSE
    clock.now += KV_RETRY_AFTER_S
    assert lookup(router) == {"w0": 4}


def test_an_answer_resets_the_count_of_missed_deadlines() -> None:
    index, clock = ScriptedIndex(), FakeClock()
    router = KvIndexRouter("unused", clock, client=KvIndexClient(None, stub=index))
    for _ in range(3):
        index.failures = [grpc.StatusCode.DEADLINE_EXCEEDED] * (KV_MISSED_DEADLINES_BEFORE_PAUSE - 1)
        for _ in range(KV_MISSED_DEADLINES_BEFORE_PAUSE - 1):
            assert lookup(router) == {}
        assert lookup(router) == {"w0": 4}


def test_an_unreachable_index_is_paused_at_once() -> None:
    index, clock = ScriptedIndex(), FakeClock()
    router = KvIndexRouter("unused", clock, client=KvIndexClient(None, stub=index))
    index.failures = [grpc.StatusCode.UNAVAILABLE]
    assert lookup(router) == {}
    clock.now += KV_RETRY_AFTER_S - 0.1
    assert lookup(router) == {} and index.calls == 1
    clock.now += 0.1
    assert lookup(router) == {"w0": 4}


def test_availability_goes_down_with_the_pause_and_up_with_the_next_answer() -> None:
    index, clock = ScriptedIndex(), FakeClock()
    heard: list[bool] = []
    router = KvIndexRouter("unused", clock, client=KvIndexClient(None, stub=index), on_availability=heard.append)
    index.failures = [grpc.StatusCode.DEADLINE_EXCEEDED]
    lookup(router)
    assert router.available and heard == []           # one slow lookup is not an outage
    index.failures = [grpc.StatusCode.UNAVAILABLE]
    lookup(router)
    assert not router.available and heard == [False]
    clock.now += KV_RETRY_AFTER_S
    assert lookup(router) == {"w0": 4}
    assert router.available and heard == [False, True]
