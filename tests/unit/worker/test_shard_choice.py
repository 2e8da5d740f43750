"""Which scheduler shard a worker joins (services/worker/shard_choice.py): the one with
the fewest workers among those that answer; workers starting together spread by their
ids; a shard that does not answer is never chosen while another does; against two real
schedulers, a third worker joins the shard that has one worker fewer; and a worker whose
shard goes away for good registers with the other one."""

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
from services.worker.shard_choice import ShardLink, choose_shard, follow_shards, pick_shard

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


def test_the_setting_is_read_and_checked() -> None:
    assert WorkerSettings.from_env({}).scheduler_shards == ()
    assert WorkerSettings.from_env({"SCHEDULER_SHARDS": "s0:50051, s1:50051"}).scheduler_shards == \
        ("s0:50051", "s1:50051")
    with pytest.raises(Exception, match="SCHEDULER_SHARDS"):
        WorkerSettings.from_env({"SCHEDULER_SHARDS": "s0"})


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
        for _ in range(200):
            if "w" in await _workers_of(addresses[0]):
                break
            await asyncio.sleep(0.02)
        assert "w" in await _workers_of(addresses[0])           # the shard with fewer workers
        await servers[0].stop(0)                                 # scaled away
        for _ in range(300):
            if "w" in await _workers_of(addresses[1]):
                break
            await asyncio.sleep(0.02)
        assert sorted(await _workers_of(addresses[1])) == ["other", "w"]
    finally:
        stop.set()
        if task is not None:
            await asyncio.wait_for(task, 10)
        if link.channel is not None:
            await link.channel.close()
        for process in others:
            await process.stop()
        await worker.stop(0)
        for server in servers:
            await server.stop(0)
