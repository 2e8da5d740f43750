"""The gateway over two scheduler shards (SCHEDULER_SHARDS), each a fake scheduler server:
new requests go to the shard with fewer in flight, a session or user stays on its shard,
cancels and detached requests find their shard, a lost shard is passed over so that the
request's continuation resumes on the other, and stats and readiness gather both."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import pytest

from common.transport.grpc_server import GrpcServer
from fairserve.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.gateway.requests.backend import SchedulerLost, Unavailable
from services.gateway.streaming.scheduler_client import SchedulerClient
from services.gateway.streaming.shards import SHARD_LOAD_SLACK, ShardedScheduler

from tests.unit.gateway.test_scheduler_client import SchedulerServicer, request


async def _server(servicer: SchedulerServicer) -> GrpcServer:
    server = GrpcServer([(scheduler_pb2_grpc.add_SchedulerServicer_to_server, servicer)],
                        ["fairserve.v1.Scheduler"], "127.0.0.1", 0)
    await server.start()
    await server.set_serving(True)
    return server


@pytest.fixture
async def shards() -> AsyncIterator[tuple[ShardedScheduler, list[SchedulerServicer], list[GrpcServer]]]:
    servicers = [SchedulerServicer(), SchedulerServicer()]
    servers = [await _server(servicer) for servicer in servicers]
    addresses = [f"127.0.0.1:{server.port}" for server in servers]
    for servicer, address in zip(servicers, addresses):
        servicer.worker_address = address
    backend = ShardedScheduler([SchedulerClient(address, address) for address in addresses], addresses)
    yield backend, servicers, servers
    await backend.close()
    for server in servers:
        await server.stop(0)


async def test_requests_spread_by_load_and_sessions_stay_on_their_shard(shards: Any) -> None:
    backend, servicers, _servers = shards
    long_a = aclosing(backend.generate(request(max_tokens=200), "a"))
    async with long_a as first, aclosing(backend.generate(request(max_tokens=200), "b")) as second:
        await anext(first)
        await anext(second)
        assert [len(s.requests) for s in servicers] == [1, 1]      # the second to the idle shard
    sessions = [backend.choose(request(session_id="chat-7")) for _ in range(5)]
    assert len(set(sessions)) == 1                                  # sticky, whatever the load
    other_tenant = {backend.choose(request(session_id="chat-7", client_id=f"t{n}")) for n in range(16)}
    assert other_tenant == {0, 1}        # keyed by tenant and session: both shards are used
    events = [event async for event in backend.generate(request(user="u1"), "c")]
    assert events[-1].finish.reason == "length" and backend.scheduler_seen


async def test_cancels_and_detached_requests_go_to_their_shard(shards: Any) -> None:
    backend, servicers, _servers = shards
    async with aclosing(backend.generate(request(max_tokens=200), "held")) as events:
        await anext(events)
        shard = next(index for index, s in enumerate(servicers) if s.requests)
        assert await backend.cancel("held")
        assert servicers[shard].cancel_ids == ["held"] and servicers[1 - shard].cancel_ids == []
    assert await backend.cancel("unknown")          # asked of every shard (the fakes say found)
    assert await backend.detached("r9", "alice") is None   # the fakes hold none


async def test_a_lost_shard_is_passed_over_and_stats_gather_both(shards: Any) -> None:
    backend, servicers, servers = shards
    view = await backend.scheduler_stats()
    assert len(view.workers) == 2 and view.details["pending"] == 2      # each fake has one pending
    assert all(view.details["shards"].values())
    assert (await backend.readiness()).ready
    async with aclosing(backend.generate(request(max_tokens=500), "doomed")) as events:
        await anext(events)
        lost = next(index for index, s in enumerate(servicers) if s.requests)
        await servers[lost].stop(0)
        with pytest.raises(SchedulerLost):
            async for _event in events:
                pass
    for _ in range(4):                       # the continuation's retries: the other shard
        assert backend.choose(request()) == 1 - lost
    events = [event async for event in backend.generate(request(), "doomed.r1")]
    assert events[-1].finish.reason == "length" and len(servicers[1 - lost].requests) == 1
    view = await backend.scheduler_stats()
    assert len(view.workers) == 1 and list(view.details["shards"].values()).count(False) == 1
    readiness = await backend.readiness()
    assert readiness.ready and len(readiness.degraded) >= 1          # served, one shard down
    await asyncio.sleep(0)


class _Index:
    """The kvcache index's lookup: `matches` for every prompt; fails when `down`."""

    def __init__(self) -> None:
        self.matches: dict[str, int] = {}
        self.down = False
        self.salts: list[str] = []

    async def __call__(self, token_ids: Any, request_id: str, cache_salt: str) -> dict[str, int]:
        self.salts.append(cache_salt)
        if self.down:
            raise Unavailable("kvcache lookup failed: UNAVAILABLE")
        return dict(self.matches)


class _NamedWorker(SchedulerServicer):
    def __init__(self, worker_id: str) -> None:
        super().__init__()
        self.worker_id = worker_id

    async def Stats(self, request: Any, context: Any) -> scheduler_pb2.SchedulerStats:
        return scheduler_pb2.SchedulerStats(workers=[scheduler_pb2.WorkerSummary(
            worker_id=self.worker_id, address=self.worker_address, healthy=True)])


async def test_a_cached_prompt_goes_to_the_shard_of_its_worker_unless_that_shard_is_overloaded() -> None:
    servicers = [_NamedWorker("wa"), _NamedWorker("wb")]
    servers = [await _server(servicer) for servicer in servicers]
    addresses = [f"127.0.0.1:{server.port}" for server in servers]
    index = _Index()
    backend = ShardedScheduler([SchedulerClient(a, a) for a in addresses], addresses, index=index)
    try:
        [event async for event in backend.generate(request(), "warm")]   # learns which worker is where
        for _ in range(100):
            if backend.choose(request(), {"wb": 64}) == 1:
                break
            await asyncio.sleep(0.02)
        index.matches = {"wb": 64, "wa": 16}           # wb, on the second shard, holds the longer prefix
        events = [event async for event in backend.generate(request(max_tokens=1), "cached")]
        assert events[-1].finish is not None and servicers[1].requests[-1].request_id == "cached"
        assert index.salts[-1] == request().cache_salt       # looked up under the request's salt
        sent = servicers[1].requests[-1]                      # the answer goes on: the shard asks no more
        assert sent.index_asked and dict(sent.cached_prefix_tokens) == {"wb": 64, "wa": 16}
        # Past the slack the holder's shard is passed over for the least loaded.
        before = [len(servicer.requests) for servicer in servicers]
        held = [aclosing(backend.generate(request(max_tokens=500), f"h{n}")) for n in range(40)]
        for stack in held:
            await anext(await stack.__aenter__())
        placed = [len(servicer.requests) - count for servicer, count in zip(servicers, before)]
        assert placed[0] + placed[1] == 40 and placed[1] > placed[0] > 0, placed
        assert placed[1] - placed[0] <= SHARD_LOAD_SLACK + 1, placed
        for stack in held:
            await stack.__aexit__(None, None, None)
        # A failing index: placed by load, and not asked again for a while.
        index.down = True
        asked = len(index.salts)
        [event async for event in backend.generate(request(max_tokens=1), "down1")]
        [event async for event in backend.generate(request(max_tokens=1), "down2")]
        assert len(index.salts) == asked + 1
        last = next(s.requests[-1] for s in servicers if s.requests[-1].request_id == "down2")
        assert not last.index_asked                           # not asked: the shard asks itself
    finally:
        await backend.close()
        for server in servers:
            await server.stop(0)
