"""The scheduler's KV-index lookups: failures route without the index, and only an
unreachable index or repeated timeouts pause the lookups; lookups asked while a call is
out go together in the next (LookupMany), and an index without LookupMany is asked one
lookup a call. Lookups not asked (one worker) are recorded: not while the index is paused,
a failure pauses it, an index without RecordLookups is not asked again."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from fairserve.v1 import kvindex_pb2

from services.kvcache.client import KvIndexClient
from services.scheduler.lookup_records import Record
from services.scheduler.kv_router import (
    KV_MISSED_DEADLINES_BEFORE_PAUSE, KV_RETRY_AFTER_S, LOOKUPS_PER_CALL, KvIndexRouter,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class ScriptedIndex:
    """A KvIndex stub whose calls fail with the queued codes, then answer each query with
    as many tokens as it has (a query of one token is refused, as a bad one would be);
    without `many`, LookupMany is UNIMPLEMENTED (an index that predates it)."""

    def __init__(self, many: bool = True) -> None:
        self.failures: list[grpc.StatusCode] = []
        self.calls = 0
        self.many = many
        self.batches: list[int] = []     # LookupMany calls' query counts
        self.gate: asyncio.Event | None = None
        self.recorded: list[tuple[int, int, str]] = []

    def _fail(self, code: grpc.StatusCode) -> None:
        raise grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), "scripted")

    async def Lookup(self, request: kvindex_pb2.LookupRequest, timeout: float,
                     metadata: object = None) -> kvindex_pb2.LookupResponse:
        self.calls += 1
        if self.failures:
            self._fail(self.failures.pop(0))
        return kvindex_pb2.LookupResponse(matches=[kvindex_pb2.WorkerMatch(
            worker_id="w0", matched_tokens=len(request.token_ids))])

    async def RecordLookups(self, request: kvindex_pb2.RecordLookupsRequest,
                            timeout: float) -> kvindex_pb2.RecordLookupsResponse:
        self.calls += 1
        if self.failures:
            self._fail(self.failures.pop(0))
        self.recorded.extend((lookup.prompt_tokens, lookup.cached_tokens, lookup.request_id)
                             for lookup in request.lookups)
        return kvindex_pb2.RecordLookupsResponse()

    async def LookupMany(self, request: kvindex_pb2.LookupManyRequest,
                         timeout: float) -> kvindex_pb2.LookupManyResponse:
        if not self.many:
            self._fail(grpc.StatusCode.UNIMPLEMENTED)
        self.calls += 1
        self.batches.append(len(request.queries))
        assert list(request.request_ids) == [f"r{len(query.token_ids)}" for query in request.queries] or \
            not any(request.request_ids)
        if self.gate is not None:
            await self.gate.wait()
        if self.failures:
            self._fail(self.failures.pop(0))
        return kvindex_pb2.LookupManyResponse(results=[
            kvindex_pb2.LookupResponse(error="refused") if len(query.token_ids) == 1 else
            kvindex_pb2.LookupResponse(matches=[kvindex_pb2.WorkerMatch(worker_id="w0",
                                                                        matched_tokens=len(query.token_ids))])
            for query in request.queries])


def lookup(router: KvIndexRouter) -> dict[str, int]:
    return asyncio.run(router.cached_prefix_tokens([1, 2, 3, 4], "r4"))


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


def test_lookups_asked_while_a_call_is_out_go_together_in_the_next() -> None:
    index, clock = ScriptedIndex(), FakeClock()
    router = KvIndexRouter("unused", clock, client=KvIndexClient(None, stub=index))

    async def burst() -> list[dict[str, int]]:
        index.gate = asyncio.Event()
        first = asyncio.ensure_future(router.cached_prefix_tokens(list(range(2)), "r2"))
        await asyncio.sleep(0)
        await asyncio.sleep(0)                  # the first call is out
        rest = [asyncio.ensure_future(router.cached_prefix_tokens(list(range(n)), f"r{n}"))
                for n in range(3, 3 + LOOKUPS_PER_CALL + 5)]
        await asyncio.sleep(0)
        index.gate.set()
        return await asyncio.gather(first, *rest)

    answers = asyncio.run(burst())
    assert answers == [{"w0": n} for n in range(2, 3 + LOOKUPS_PER_CALL + 5)]    # each its own answer
    assert index.batches == [1, LOOKUPS_PER_CALL, 5]


def test_a_refused_query_routes_its_request_without_the_index_and_the_others_are_answered() -> None:
    index, clock = ScriptedIndex(), FakeClock()
    router = KvIndexRouter("unused", clock, client=KvIndexClient(None, stub=index))

    async def together() -> list[dict[str, int]]:
        return await asyncio.gather(*(router.cached_prefix_tokens(list(range(n)), f"r{n}") for n in (4, 1, 5)))

    assert asyncio.run(together()) == [{"w0": 4}, {}, {"w0": 5}] and router.available


def test_a_failed_call_is_one_missed_deadline_however_many_lookups_it_carried() -> None:
    index, clock = ScriptedIndex(), FakeClock()
    router = KvIndexRouter("unused", clock, client=KvIndexClient(None, stub=index))
    index.failures = [grpc.StatusCode.DEADLINE_EXCEEDED]

    async def together() -> list[dict[str, int]]:
        return await asyncio.gather(*(router.cached_prefix_tokens(list(range(n)), f"r{n}") for n in range(2, 12)))

    assert asyncio.run(together()) == [{}] * 10
    assert lookup(router) == {"w0": 4}       # not paused: one slow call is not an outage


def test_an_index_without_lookup_many_is_asked_a_lookup_a_call() -> None:
    index, clock = ScriptedIndex(many=False), FakeClock()
    router = KvIndexRouter("unused", clock, client=KvIndexClient(None, stub=index))

    async def together() -> list[dict[str, int]]:
        return await asyncio.gather(*(router.cached_prefix_tokens(list(range(n)), f"r{n}") for n in (2, 3)))

    assert asyncio.run(together()) == [{"w0": 2}, {"w0": 3}] and index.calls == 2
    assert lookup(router) == {"w0": 4} and index.calls == 3 and index.batches == []


def test_recorded_lookups_reach_the_index_and_a_failure_pauses_it() -> None:
    index, clock = ScriptedIndex(), FakeClock()
    heard: list[bool] = []
    router = KvIndexRouter("unused", clock, client=KvIndexClient(None, stub=index), on_availability=heard.append)
    asyncio.run(router.record_lookups([Record(20, 16, "r1")]))
    assert index.recorded == [(20, 16, "r1")]
    index.failures = [grpc.StatusCode.UNAVAILABLE]
    with pytest.raises(grpc.aio.AioRpcError):
        asyncio.run(router.record_lookups([Record(20, 0, "r2")]))
    assert heard == [False]
    asyncio.run(router.record_lookups([Record(20, 0, "r3")]))      # paused: not sent
    assert index.calls == 2
    clock.now += KV_RETRY_AFTER_S
    asyncio.run(router.record_lookups([Record(20, 0, "r4")]))
    assert index.recorded[-1] == (20, 0, "r4") and heard == [False, True]


def test_an_index_without_record_lookups_is_not_asked_again() -> None:
    index, clock = ScriptedIndex(), FakeClock()
    router = KvIndexRouter("unused", clock, client=KvIndexClient(None, stub=index))
    index.failures = [grpc.StatusCode.UNIMPLEMENTED]
    asyncio.run(router.record_lookups([Record(20, 16, "r1")]))
    asyncio.run(router.record_lookups([Record(20, 16, "r2")]))
    assert index.calls == 1 and router.available
