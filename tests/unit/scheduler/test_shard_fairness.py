"""Fairness across scheduler shards (SCHEDULER_PEERS): the growth of a peer's own charges
(peer_charges.py) added to this shard's counters, and two shards in lockstep where one
tenant can only be served on the first (its cache or sessions live there) while another
is served on both. Without the exchange each shard splits itself evenly and the pinned
tenant gets a quarter of all tokens; with it, the first shard sees how much the other
tenant gets on the second and serves the pinned one first, which is what one scheduler
over all the workers would do."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import replace

import grpc
import pytest
from fairserve.v1 import scheduler_pb2, scheduler_pb2_grpc
from prometheus_client import generate_latest

from common.transport.grpc_server import GrpcServer
from common.transport.internal_auth import InternalAuth
from services.scheduler.core.fairness.peer_charges import PeerCharges
from services.scheduler.core.fairness.vtc import VirtualTokenCounter
from services.scheduler.core.types import CoreConfig, Policy
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.peer_exchange import PeerHandlers, exchange_with_peers, scheduler_peer_handlers

from tests.unit.scheduler.fake_worker import FakeEngine
from tests.unit.scheduler.harness import Harness


def test_growth_starts_from_a_baseline_and_restarts_when_a_figure_goes_down() -> None:
    charges = PeerCharges()
    assert charges.growth("p", {"a": 10.0}) == {}                      # the first read: a baseline
    assert charges.growth("p", {"a": 25.0, "b": 4.0}) == {"a": 15.0, "b": 4.0}
    assert charges.growth("p", {"a": 25.0, "b": 4.0}) == {}
    assert charges.growth("p", {"a": 3.0}) == {"a": 3.0}                # forgotten, then back
    assert charges.growth("q", {"a": 99.0}) == {}                        # each peer its own baseline


def test_service_elsewhere_raises_a_known_clients_counter_only() -> None:
    vtc = VirtualTokenCounter(1.0, 2.0)
    vtc.lift_on_arrival("a", [])
    vtc.charge_output("a", 3)
    vtc.charge_elsewhere("a", 10.0)
    vtc.charge_elsewhere("stranger", 10.0)      # no counter here: lifted on arrival instead
    (counter,) = vtc.snapshot()
    assert counter.client_id == "a" and counter.counter == pytest.approx(16.0)
    assert counter.served_tokens == 3 and counter.charged == pytest.approx(6.0)   # its own only
    assert len(vtc) == 1


PROMPT, MAX_TOKENS, BACKLOG = 8, 8, 6


def _served_shares(exchange: bool, steps: int = 300) -> dict[str, float]:
    config = CoreConfig(policy=Policy.VTC, max_batch_size=2, vtc_input_weight=1.0, vtc_output_weight=1.0)
    shards = [Harness(config, FakeEngine(num_blocks=4096)) for _ in range(2)]
    tenants = {0: ("pinned", "spread"), 1: ("spread",)}
    charges = [PeerCharges(), PeerCharges()]
    mine: dict[tuple[int, str], list[str]] = {}
    submitted = 0
    served = {"pinned": 0, "spread": 0}
    for _ in range(steps):
        for index, shard in enumerate(shards):
            for tenant in tenants[index]:   # each tenant keeps BACKLOG requests waiting on its shards
                ids = mine.setdefault((index, tenant), [])
                ids[:] = [rid for rid in ids if not shard.streams[rid].done]
                while len(ids) < BACKLOG:
                    submitted += 1
                    ids.append(shard.submit(range(submitted * 100, submitted * 100 + PROMPT),
                                            max_tokens=MAX_TOKENS, client_id=tenant).request_id)
        before = [{c.client_id: c.served_tokens for c in shard.core.stats().clients} for shard in shards]
        for shard in shards:
            shard.step()
        for index, shard in enumerate(shards):
            for client in shard.core.stats().clients:
                served[client.client_id] += client.served_tokens - before[index].get(client.client_id, 0)
        if exchange:
            for index, shard in enumerate(shards):
                peer = shards[1 - index].core.stats().clients
                shard.core.charge_elsewhere(charges[index].growth("peer", {c.client_id: c.charged for c in peer}))
    total = sum(served.values())
    return {tenant: tokens / total for tenant, tokens in served.items()}


def test_a_tenant_pinned_to_one_shard_gets_its_fair_share_only_with_the_exchange() -> None:
    alone = _served_shares(exchange=False)
    shared = _served_shares(exchange=True)
    assert alone["pinned"] == pytest.approx(0.25, abs=0.05)     # half of one shard of two
    assert shared["pinned"] == pytest.approx(0.5, abs=0.07)     # as one scheduler over both


class _Peer(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self) -> None:
        self.charged = {"a": 1.0}
        self.instance_id = ""
        self.calls = 0

    async def Stats(self, request: object, context: grpc.aio.ServicerContext) -> scheduler_pb2.SchedulerStats:
        self.calls += 1
        return scheduler_pb2.SchedulerStats(clients=[scheduler_pb2.ClientCounter(client_id=c, charged=v)
                                                     for c, v in self.charged.items()],
                                            instance_id=self.instance_id)


async def _serve(peer: _Peer) -> GrpcServer:
    server = GrpcServer([(scheduler_pb2_grpc.add_SchedulerServicer_to_server, peer)],
                        ["fairserve.v1.Scheduler"], "127.0.0.1", 0)
    await server.start()
    return server


async def _until_then_stop(condition: Callable[[], bool], task: asyncio.Task[None],
                           servers: list[GrpcServer]) -> None:
    """Waits (4 s at most) for `condition`, then stops the exchange and the peers."""
    for _ in range(200):
        if condition():
            break
        await asyncio.sleep(0.02)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    for server in servers:
        await server.stop(0)


async def test_the_exchange_reads_each_peer_and_goes_on_past_one_that_is_down() -> None:
    """The growth of the answering peer's charges; the silent one on the peer gauge at 0
    (its quota holds forgotten), the answering one at 1."""
    peer = _Peer()
    server = await _serve(peer)
    received: list[dict[str, float]] = []
    metrics = SchedulerMetrics()
    core = Harness(CoreConfig(), FakeEngine(num_blocks=64)).core
    handlers = replace(scheduler_peer_handlers(core, metrics), charge=lambda grown: received.append(dict(grown)))
    task = asyncio.create_task(exchange_with_peers([f"127.0.0.1:{server.port}", "127.0.0.1:1"], 0.02,
                                                   InternalAuth(), handlers))
    await asyncio.sleep(0.3)                     # a baseline read, then nothing has grown
    peer.charged = {"a": 4.0, "b": 2.0}
    await _until_then_stop(lambda: bool(received), task, [server])
    assert received[0] == {"a": 3.0, "b": 2.0}
    exported = generate_latest(metrics.registry).decode()
    assert 'fairserve_scheduler_peers{state="answering"} 1.0' in exported
    assert 'fairserve_scheduler_peers{state="silent"} 1.0' in exported


async def test_a_scheduler_named_among_its_own_peers_leaves_itself_out() -> None:
    """SCHEDULER_PEERS may list every shard, this one included (one setting for a
    StatefulSet): the peer answering with this scheduler's instance id is never counted."""
    myself, other = _Peer(), _Peer()
    servers = [await _serve(peer) for peer in (myself, other)]
    myself.instance_id, other.instance_id = "me", "other"
    grown_by_call: list[dict[str, float]] = []
    read: list[str] = []
    left_out: list[str] = []
    handlers = PeerHandlers(lambda grown: grown_by_call.append(dict(grown)),
                            quotas=lambda peer, stats: read.append(peer), itself=left_out.append)
    task = asyncio.create_task(exchange_with_peers(
        [f"127.0.0.1:{server.port}" for server in servers], 0.02, InternalAuth(), handlers, "me"))
    await asyncio.sleep(0.2)
    myself.charged = other.charged = {"a": 5.0}
    await _until_then_stop(lambda: bool(grown_by_call), task, servers)
    assert grown_by_call == [{"a": 4.0}]                     # the other's growth only, once
    assert set(read) == {f"127.0.0.1:{servers[1].port}"}
    assert myself.calls == 1                                 # asked once, then left out
    assert left_out == [f"127.0.0.1:{servers[0].port}"]
