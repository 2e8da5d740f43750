"""Which scheduler shard a worker joins (services/worker/shard_choice.py): the one with
the fewest workers among those that answer; workers starting together spread by their
ids; a shard that does not answer is never chosen while another does; against two real
schedulers, a third worker joins the shard that has one worker fewer; a worker whose
shard goes away for good registers with the other one; and when the shards drift apart
(workers scaled away from one), half the difference moves, each worker of the fuller
shard agreeing on which without talking, after draining where it was."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import replace

import pytest
from fairserve.v1 import common_pb2, scheduler_pb2_grpc, worker_pb2_grpc

from common.transport.grpc_server import GrpcServer, insecure_channel, internal_channel
from common.transport.internal_auth import InternalAuth
from services.scheduler.server import SchedulerServer
from services.worker.server import keep_registered
from services.worker.settings import WorkerSettings
from services.worker.drain import leave
from services.worker.shard_choice import (
    MOVE_RANK_SALT,
    Rebalancing,
    ShardLink,
    _rank,
    choose_shard,
    follow_shards,
    pick_shard,
    shard_to_move_to,
)

from tests.unit.scheduler.fake_worker import FakeEngine
from tests.unit.scheduler.fake_worker_server import FakeWorkerProcess, FakeWorkerServicer
from tests.unit.scheduler.test_transport import BASE


def test_the_shard_with_the_fewest_workers_is_joined() -> None:
    assert pick_shard({"a:1": 3, "b:1": 1, "c:1": 2}, "w") == "b:1"
    assert pick_shard({"a:1": None, "b:1": 5}, "w") == "b:1"          # only the answering


def test_workers_starting_together_spread_over_equal_shards() -> None:
    shards = {f"scheduler-{i}:50051": 0 for i in range(4)}
    joined = Counter(pick_shard(shards, f"worker-{n}") for n in range(400))
    assert set(joined) == set(shards) and min(joined.values()) > 60    # ~100 each
    assert pick_shard(shards, "worker-7") == pick_shard(dict(reversed(shards.items())), "worker-7")


def test_with_no_shard_answering_the_worker_still_picks_one() -> None:
    assert pick_shard({"a:1": None, "b:1": None}, "w") in {"a:1", "b:1"}
    with pytest.raises(ValueError):
        pick_shard({}, "w")


def test_half_the_difference_moves_and_the_fuller_shards_workers_agree_on_which() -> None:
    a = [f"a{n}" for n in range(5)]
    shards = {"a:1": a, "b:1": ["b0"], "c:1": None}          # c does not answer: left out
    moving = {worker: shard_to_move_to(shards, "a:1", worker) for worker in a}
    assert sorted(target for target in moving.values() if target) == ["b:1", "b:1"]   # (5 - 1) // 2
    movers = {worker for worker, target in moving.items() if target}
    assert movers == set(sorted(a, key=lambda worker: _rank(worker, MOVE_RANK_SALT))[:2])
    assert shard_to_move_to(shards, "b:1", "b0") is None                 # the emptier stays


def test_shards_one_worker_apart_stay_as_they_are() -> None:
    assert shard_to_move_to({"a:1": ["a0", "a1"], "b:1": ["b0"]}, "a:1", "a0") is None
    assert shard_to_move_to({"a:1": ["a0", "a1"], "b:1": ["b0"]}, "a:1", "a1") is None
    assert shard_to_move_to({"a:1": ["a0"], "b:1": []}, "a:1", "a0") is None
    # Not listed where it serves (not registered yet, or its shard did not answer): no move.
    assert shard_to_move_to({"a:1": ["a0", "a1", "a2"], "b:1": []}, "a:1", "w") is None
    assert shard_to_move_to({"a:1": None, "b:1": []}, "a:1", "a0") is None


def test_the_setting_is_read_and_checked() -> None:
    assert WorkerSettings.from_env({}).scheduler_shards == ()
    assert WorkerSettings.from_env({"SCHEDULER_SHARDS": "s0:50051, s1:50051"}).scheduler_shards == \
        ("s0:50051", "s1:50051")
    with pytest.raises(Exception, match="SCHEDULER_SHARDS"):
        WorkerSettings.from_env({"SCHEDULER_SHARDS": "s0"})
    assert WorkerSettings.from_env({}).shard_rebalance_s == 30.0
    assert WorkerSettings.from_env({"SCHEDULER_SHARD_REBALANCE_S": "0"}).shard_rebalance_s == 0.0
    with pytest.raises(Exception, match="SCHEDULER_SHARD_REBALANCE_S"):
        WorkerSettings.from_env({"SCHEDULER_SHARD_REBALANCE_S": "-1"})


async def test_a_new_worker_joins_the_real_shard_with_fewer_workers() -> None:
    servers = [SchedulerServer(replace(BASE)) for _ in range(2)]
    workers: list[FakeWorkerProcess] = []
    try:
        for server in servers:
            await server.start()
        addresses = [f"127.0.0.1:{server.port}" for server in servers]
        for worker_id in ("w0", "w1"):              # two on the first shard, none on the second
            worker = FakeWorkerProcess(FakeEngine(num_blocks=64), worker_id, addresses[0])
            await worker.start()
            workers.append(worker)
        assert await choose_shard(addresses, InternalAuth(), "w2") == addresses[1]
        assert await choose_shard([addresses[0], "127.0.0.1:1"], InternalAuth(), "w2") == addresses[0]
    finally:
        for worker in workers:
            await worker.stop()
        for server in servers:
            await server.stop(0)


class _Service:
    """What keep_registered needs of the worker service: its epoch."""

    def __init__(self) -> None:
        self.epoch = 0

    async def adopt_epoch(self, epoch: int) -> None:
        self.epoch = epoch


async def test_registration_gives_up_on_a_scheduler_unreachable_for_long() -> None:
    channel = internal_channel("127.0.0.1:1", InternalAuth())
    started = time.monotonic()
    await asyncio.wait_for(keep_registered(channel, "w", "127.0.0.1:2", _Service(), 0.05, asyncio.Event(),
                                           lost_after_s=0.3), 10)
    assert time.monotonic() - started >= 0.3
    await channel.close()


async def _workers_of(address: str) -> list[str]:
    channel = insecure_channel(address)
    try:
        stats = await scheduler_pb2_grpc.SchedulerStub(channel).Stats(common_pb2.StatsRequest(), timeout=5)
        return [worker.worker_id for worker in stats.workers]
    finally:
        await channel.close()


async def _until_listed(address: str, worker_id: str, present: bool = True) -> bool:
    for _ in range(400):
        if (worker_id in await _workers_of(address)) == present:
            return True
        await asyncio.sleep(0.02)
    return False


async def _tear_down(stop: asyncio.Event, task: asyncio.Task[None] | None, link: ShardLink,
                     processes: list[FakeWorkerProcess], worker: GrpcServer, servers: list[SchedulerServer]) -> None:
    stop.set()
    if task is not None:
        await asyncio.wait_for(task, 10)
    if link.channel is not None:
        await link.channel.close()
    for process in processes:
        await process.stop()
    await worker.stop(0)
    for server in servers:
        await server.stop(0)


async def test_a_worker_whose_shard_is_gone_registers_with_another() -> None:
    servers = [SchedulerServer(replace(BASE)) for _ in range(2)]
    worker = GrpcServer([(worker_pb2_grpc.add_WorkerServicer_to_server, FakeWorkerServicer(FakeEngine(), "w"))],
                        ["fairserve.v1.Worker"], "127.0.0.1", 0)
    others: list[FakeWorkerProcess] = []
    stop, link = asyncio.Event(), ShardLink()
    task = None
    try:
        for server in servers:
            await server.start()
        await worker.start()
        addresses = [f"127.0.0.1:{server.port}" for server in servers]
        other = FakeWorkerProcess(FakeEngine(num_blocks=64), "other", addresses[1])   # the second has one
        await other.start()
        others.append(other)
        task = asyncio.create_task(follow_shards(
            addresses, InternalAuth(), "w", lambda address: internal_channel(address, InternalAuth()),
            lambda channel: keep_registered(channel, "w", f"127.0.0.1:{worker.port}", _Service(), 0.05, stop,
                                            lost_after_s=0.3), link, stop))
        assert await _until_listed(addresses[0], "w")           # the shard with fewer workers
        await servers[0].stop(0)                                 # scaled away
        assert await _until_listed(addresses[1], "w")
        assert sorted(await _workers_of(addresses[1])) == ["other", "w"]
    finally:
        await _tear_down(stop, task, link, others, worker, servers)


async def test_a_worker_moves_from_a_fuller_shard_after_draining_there() -> None:
    servers = [SchedulerServer(replace(BASE)) for _ in range(2)]
    worker = GrpcServer([(worker_pb2_grpc.add_WorkerServicer_to_server, FakeWorkerServicer(FakeEngine(), "w"))],
                        ["fairserve.v1.Worker"], "127.0.0.1", 0)
    fixed: dict[str, FakeWorkerProcess] = {}
    stop, link, drained_from = asyncio.Event(), ShardLink(), []
    task = None

    async def leave_recorded(channel: object) -> object:
        drained_from.append(channel)
        return await leave(channel, "w", 5.0, stop)   # type: ignore[arg-type]

    try:
        for server in servers:
            await server.start()
        await worker.start()
        a, b = (f"127.0.0.1:{server.port}" for server in servers)
        for worker_id, address in (("o1", a), ("b1", b), ("b2", b)):
            fixed[worker_id] = FakeWorkerProcess(FakeEngine(num_blocks=64), worker_id, address)
            await fixed[worker_id].start()
        assert _rank("w", MOVE_RANK_SALT) < _rank("o1", MOVE_RANK_SALT)     # "w" is the one to move
        task = asyncio.create_task(follow_shards(
            [a, b], InternalAuth(), "w", lambda address: internal_channel(address, InternalAuth()),
            lambda channel: keep_registered(channel, "w", f"127.0.0.1:{worker.port}", _Service(), 0.05, stop),
            link, stop, Rebalancing(0.1, leave_recorded)))
        assert await _until_listed(a, "w")                     # the emptier shard then: 1 against 2
        await fixed.pop("b2").stop()                           # 2 against 1: one apart, nobody moves
        await asyncio.sleep(0.6)
        assert sorted(await _workers_of(a)) == ["o1", "w"] and drained_from == []
        await fixed.pop("b1").stop()                           # 2 against 0: one of the two moves
        assert await _until_listed(b, "w")
        assert await _until_listed(a, "w", present=False)      # drained, so the first shard dropped it
        assert len(drained_from) == 1 and sorted(await _workers_of(a)) == ["o1"]
        await asyncio.sleep(0.4)                               # 1 against 1: it stays
        assert await _workers_of(b) == ["w"] and len(drained_from) == 1
    finally:
        await _tear_down(stop, task, link, list(fixed.values()), worker, servers)
