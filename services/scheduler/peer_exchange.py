"""Scheduler shards exchange their clients' service and their tenants' quota holds
(SCHEDULER_PEERS): every PEER_EXCHANGE_S this scheduler reads each peer's Stats, adds
the growth of the peer's own charges to its counters (core/fairness/peer_charges.py)
and hands its tenants' quota holds to `quotas` (core/fairness/peer_quotas.py). A peer
that does not answer is skipped until it does (`lost` is told, once): its service
meanwhile is counted when it answers again (its figures are cumulative). A peer that
answers with this scheduler's own instance id is this scheduler (SCHEDULER_PEERS may
list every shard, itself included: one setting for all of them) and is left out."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence

import grpc
from fairserve.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

from common.transport.grpc_server import internal_channel
from common.transport.internal_auth import InternalAuth
from services.scheduler.core.fairness.peer_charges import PeerCharges

log = logging.getLogger(__name__)


async def exchange_with_peers(peers: Sequence[str], interval_s: float, auth: InternalAuth,
                              charge: Callable[[Mapping[str, float]], None], instance_id: str = "",
                              quotas: Callable[[str, scheduler_pb2.SchedulerStats], None] = lambda *_: None,
                              lost: Callable[[str], None] = lambda _: None) -> None:
    """Runs until cancelled: each peer's growth since the last read goes to `charge`, its
    stats to `quotas` (with the peer's address); a peer that stops answering to `lost`."""
    channels = {peer: internal_channel(peer, auth) for peer in peers}
    stubs = {peer: scheduler_pb2_grpc.SchedulerStub(channel) for peer, channel in channels.items()}
    charges = PeerCharges()
    silent: set[str] = set()
    try:
        while True:
            await asyncio.sleep(interval_s)
            for peer, stub in list(stubs.items()):
                try:
                    stats = await stub.Stats(common_pb2.StatsRequest(), timeout=max(1.0, 5 * interval_s))
                except grpc.aio.AioRpcError as error:
                    if peer not in silent:
                        silent.add(peer)
                        lost(peer)
                        log.warning("scheduler peer not answering", extra={"peer": peer,
                                                                           "error": error.code().name})
                    continue
                if peer in silent:
                    silent.discard(peer)
                    log.info("scheduler peer answering again", extra={"peer": peer})
                if instance_id and stats.instance_id == instance_id:
                    log.info("SCHEDULER_PEERS names this scheduler itself: left out", extra={"peer": peer})
                    del stubs[peer]
                    continue
                grown = charges.growth(peer, {client.client_id: client.charged for client in stats.clients})
                if grown:
                    charge(grown)
                quotas(peer, stats)
    finally:
        for channel in channels.values():
            await channel.close()
