"""Which scheduler shard a worker joins (SCHEDULER_SHARDS; docs/scaling.md).

With shards, each scheduler steps its own pool of workers, and one worker Deployment
serves them all: at start a worker asks every shard how many workers it has and joins
the one with the fewest, ties going to the shard that ranks highest for this worker
id (rendezvous hashing), so workers that start together spread over the shards
instead of all joining the first. No shard answering, it takes its rendezvous shard
and registers there as soon as it answers. A worker stays with its shard while it can
reach it (a shard is a StatefulSet pod: restarted, it comes back at the same address
and its workers register again); one it has not reached for SHARD_LOST_S (a shard
scaled away, or gone for good) it leaves, and chooses again among the others."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence

import grpc
from fairserve.v1 import common_pb2, scheduler_pb2_grpc

from common.transport.grpc_server import internal_channel
from common.transport.internal_auth import InternalAuth

log = logging.getLogger(__name__)

ASK_TIMEOUT_S = 2.0
SHARD_LOST_S = 60.0      # unreachable this long, a worker's shard is left for another


def pick_shard(worker_counts: Mapping[str, int | None], worker_id: str) -> str:
    """The shard to join.

    Args:
        worker_counts: each shard's address -> its registered workers (None: it did not answer).
        worker_id: this worker's id.
    Returns:
        the answering shard with the fewest workers, ties to the one ranking highest for
        `worker_id`; with none answering, the highest ranking of all.
    """
    if not worker_counts:
        raise ValueError("no scheduler shards to choose from")
    answering = {address: count for address, count in worker_counts.items() if count is not None}
    if answering:
        fewest = min(answering.values())
        candidates = [address for address, count in answering.items() if count == fewest]
    else:
        candidates = list(worker_counts)
    return max(candidates, key=lambda address: _rank(worker_id, address))


def _rank(worker_id: str, address: str) -> bytes:
    return hashlib.sha256(f"{worker_id}\n{address}".encode()).digest()


async def choose_shard(shards: Sequence[str], auth: InternalAuth, worker_id: str) -> str:
    """Asks every shard for its workers at once (ASK_TIMEOUT_S) and picks one (pick_shard)."""
    counts = await asyncio.gather(*(_workers_at(address, auth) for address in shards))
    choice = pick_shard(dict(zip(shards, counts)), worker_id)
    log.info("scheduler shard chosen", extra={"shard": choice, "workers_by_shard": dict(zip(shards, counts))})
    return choice


class ShardLink:
    """The channel to the shard the worker serves now (None before the first choice):
    its drain leaves through it."""

    def __init__(self) -> None:
        self.channel: grpc.aio.Channel | None = None


async def follow_shards(shards: Sequence[str], auth: InternalAuth, worker_id: str,
                        connect: Callable[[str], grpc.aio.Channel],
                        register: Callable[[grpc.aio.Channel], Awaitable[None]],
                        link: ShardLink, stop: asyncio.Event) -> None:
    """Chooses a shard, connects (`connect`) and stays registered there (`register`,
    which returns when `stop` is set or the shard has been unreachable too long); then,
    unless stopping, chooses again. Runs until `stop` is set or it is cancelled."""
    while not stop.is_set():
        address = await choose_shard(shards, auth, worker_id)
        left, link.channel = link.channel, connect(address)     # the drain never finds a closed one
        if left is not None:
            await left.close()
        await register(link.channel)
        if not stop.is_set():
            log.warning("scheduler shard lost: choosing again", extra={"shard": address})


async def _workers_at(address: str, auth: InternalAuth) -> int | None:
    channel = internal_channel(address, auth)
    try:
        stats = await scheduler_pb2_grpc.SchedulerStub(channel).Stats(common_pb2.StatsRequest(),
                                                                       timeout=ASK_TIMEOUT_S)
        return len(stats.workers)
    except grpc.aio.AioRpcError:
        return None
    finally:
        await channel.close()
