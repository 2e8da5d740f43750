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
from fairserve.v1 import scheduler_pb2_grpc
from services.gateway.requests.backend import SchedulerLost
from services.gateway.streaming.scheduler_client import SchedulerClient
from services.gateway.streaming.shards import ShardedScheduler

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
