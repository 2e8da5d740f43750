"""Which scheduler shard a worker joins (services/worker/shard_choice.py): the one with
the fewest workers among those that answer; workers starting together spread by their
ids; a shard that does not answer is never chosen while another does; and, against two
real schedulers, a third worker joins the shard that has one worker fewer."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest

from common.transport.internal_auth import InternalAuth
from services.scheduler.server import SchedulerServer
from services.worker.settings import WorkerSettings
from services.worker.shard_choice import choose_shard, pick_shard

from tests.unit.scheduler.fake_worker import FakeEngine
from tests.unit.scheduler.fake_worker_server import FakeWorkerProcess
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
