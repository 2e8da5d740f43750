"""Scheduler shards exchange their clients' service and their tenants' quota holds
(SCHEDULER_PEERS): every PEER_EXCHANGE_S this scheduler reads each peer's Stats, adds
the growth of the peer's own charges to its counters (core/fairness/peer_charges.py)
and hands its tenants' quota holds to `quotas` (core/fairness/peer_quotas.py). A peer
that does not answer is skipped until it does (its availability told, as a gauge): its service
meanwhile is counted when it answers again (its figures are cumulative). A peer that
answers with this scheduler's own instance id is this scheduler (SCHEDULER_PEERS may
list every shard, itself included: one setting for all of them) and is left out."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import grpc
from fairserve.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

from common.transport.grpc_server import internal_channel
from common.transport.internal_auth import InternalAuth
from services.scheduler import convert
from services.scheduler.core.fairness.peer_charges import PeerCharges
from services.scheduler.core.scheduler import SchedulerCore
from services.scheduler.metrics import SchedulerMetrics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PeerHandlers:
    """Where the exchange hands what it reads."""
    charge: Callable[[Mapping[str, float]], None]       # clients' service growth on a peer
    quotas: Callable[[str, scheduler_pb2.SchedulerStats], None] = lambda *_: None   # a peer's stats
    availability: Callable[[str, bool], None] = lambda *_: None   # a peer answering (again), or not
    itself: Callable[[str], None] = lambda _: None       # an address that turned out to be this scheduler


def scheduler_peer_handlers(core: SchedulerCore, metrics: SchedulerMetrics) -> PeerHandlers:
    """The scheduler's: fairness and quotas to its core, availability to its metrics (a
    silent peer's holds forgotten)."""
    def availability(peer: str, up: bool) -> None:
        metrics.set_peer_up(peer, up)
        if not up:
            core.forget_peer(peer)

    return PeerHandlers(
        charge=core.charge_elsewhere,
        quotas=lambda peer, stats: core.note_peer_quotas(peer, convert.quota_usages_from_proto(stats)),
        availability=availability, itself=metrics.forget_peer)


async def exchange_with_peers(peers: Sequence[str], interval_s: float, auth: InternalAuth,
                              handlers: PeerHandlers, instance_id: str = "") -> None:
    """Runs until cancelled: reads every peer each `interval_s` and hands what it read to
    `handlers`; a peer answering with `instance_id` is this scheduler and is left out."""
    channels = {peer: internal_channel(peer, auth) for peer in peers}
    stubs = {peer: scheduler_pb2_grpc.SchedulerStub(channel) for peer, channel in channels.items()}
    charges = PeerCharges()
    answering: dict[str, bool] = {}
    try:
        while True:
            await asyncio.sleep(interval_s)
            for peer, stub in list(stubs.items()):
                try:
                    stats = await stub.Stats(common_pb2.StatsRequest(), timeout=max(1.0, 5 * interval_s))
                except grpc.aio.AioRpcError as error:
                    if answering.get(peer, True):
                        answering[peer] = False
                        handlers.availability(peer, False)
                        log.warning("scheduler peer not answering", extra={"peer": peer,
                                                                           "error": error.code().name})
                    continue
                if instance_id and stats.instance_id == instance_id:
                    log.info("SCHEDULER_PEERS names this scheduler itself: left out", extra={"peer": peer})
                    del stubs[peer]
                    handlers.itself(peer)
                    continue
                if not answering.get(peer, False):
                    if peer in answering:
                        log.info("scheduler peer answering again", extra={"peer": peer})
                    answering[peer] = True
                    handlers.availability(peer, True)
                grown = charges.growth(peer, {client.client_id: client.charged for client in stats.clients})
                if grown:
                    handlers.charge(grown)
                handlers.quotas(peer, stats)
    finally:
        for channel in channels.values():
            await channel.close()
