"""Which scheduler shard a worker joins (SCHEDULER_SHARDS; docs/scaling.md).

With shards, each scheduler steps its own pool of workers, and one worker Deployment
serves them all: at start a worker asks every shard how many workers it has and joins
the one with the fewest, ties going to the shard that ranks highest for this worker
id (rendezvous hashing), so workers that start together spread over the shards
instead of all joining the first. No shard answering, it takes its rendezvous shard
and registers there as soon as it answers. A worker stays with its shard while it can
reach it (a shard is a StatefulSet pod: restarted, it comes back at the same address
and its workers register again); one it has not reached for SHARD_LOST_S (a shard
scaled away, or gone for good) it leaves, and chooses again among the others.

Workers come and go (an autoscaler removes them where it likes, a shard is added), so the
shards drift apart. Every SCHEDULER_SHARD_REBALANCE_S a worker looks again: when its shard
has at least two workers more than the emptiest one, half the difference moves there
(`shard_to_move_to`). Every worker of the shard reads the same lists and ranks them the
same way, so they agree on which move without talking to each other; a mover drains from
its shard first (its requests resume on the shard's other workers, drain.py) and then
registers with the emptier one."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

import grpc
from fairserve.v1 import common_pb2, scheduler_pb2_grpc

from common.transport.grpc_server import internal_channel
from common.transport.internal_auth import InternalAuth

log = logging.getLogger(__name__)

ASK_TIMEOUT_S = 2.0
SHARD_LOST_S = 60.0      # unreachable this long, a worker's shard is left for another
MOVE_RANK_SALT = "move"  # what ranks a shard's workers for moving (not the ranking that placed them)


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


def shard_to_move_to(workers: Mapping[str, Sequence[str] | None], current: str, worker_id: str) -> str | None:
    """Where this worker moves to even out the shards, if it does.

    Args:
        workers: each shard's address -> the ids of its registered workers (None: it did
            not answer; it is left out).
        current: the shard this worker serves.
        worker_id: this worker's id.
    Returns:
        the emptiest answering shard (ties as `pick_shard`) when `current` holds at least two
        workers more and this worker ranks among the (difference // 2) of `current`'s
        workers that move; else None (balanced, or others move).
    """
    answering = {address: ids for address, ids in workers.items() if ids is not None}
    here = answering.get(current)
    if here is None or worker_id not in here:
        return None
    target = pick_shard({address: len(ids) for address, ids in answering.items()}, worker_id)
    surplus = (len(here) - len(answering[target])) // 2
    if target == current or surplus <= 0:
        return None
    movers = sorted(here, key=lambda other: _rank(other, MOVE_RANK_SALT))[:surplus]
    return target if worker_id in movers else None


async def choose_shard(shards: Sequence[str], auth: InternalAuth, worker_id: str) -> str:
    """Asks every shard for its workers at once (ASK_TIMEOUT_S) and picks one (pick_shard)."""
    workers = await _workers_by_shard(shards, auth)
    counts = {address: None if ids is None else len(ids) for address, ids in workers.items()}
    choice = pick_shard(counts, worker_id)
    log.info("scheduler shard chosen", extra={"shard": choice, "workers_by_shard": counts})
    return choice


class ShardLink:
    """The channel to the shard the worker serves now (None before the first choice):
    its drain leaves through it."""

    def __init__(self) -> None:
        self.channel: grpc.aio.Channel | None = None


@dataclass(frozen=True)
class Rebalancing:
    """Moving between shards to even them out (off when `every_s` is 0).

    Attributes:
        every_s: seconds between looks at the shards' workers.
        leave: drains the worker from the shard behind a channel before it moves.
    """
    every_s: float
    leave: Callable[[grpc.aio.Channel], Awaitable[object]]


async def follow_shards(shards: Sequence[str], auth: InternalAuth, worker_id: str,
                        connect: Callable[[str], grpc.aio.Channel],
                        register: Callable[[grpc.aio.Channel], Awaitable[None]],
                        link: ShardLink, stop: asyncio.Event,
                        rebalancing: Rebalancing | None = None) -> None:
    """Chooses a shard, connects (`connect`) and stays registered there (`register`,
    which returns when `stop` is set or the shard has been unreachable too long); then,
    unless stopping, chooses again. With `rebalancing`, it also moves to an emptier shard
    when it is among the workers that even them out (`shard_to_move_to`). Runs until
    `stop` is set or it is cancelled."""
    target: str | None = None
    while not stop.is_set():
        address = target or await choose_shard(shards, auth, worker_id)
        left, link.channel = link.channel, connect(address)     # the drain never finds a closed one
        if left is not None:
            await left.close()
        target = await _serve_shard(shards, auth, worker_id, address, register(link.channel),
                                    rebalancing, stop)
        if target is not None and rebalancing is not None:
            log.info("moving to a scheduler shard with fewer workers",
                     extra={"shard": address, "to_shard": target})
            await rebalancing.leave(link.channel)
        elif not stop.is_set():
            log.warning("scheduler shard lost: choosing again", extra={"shard": address})


async def _serve_shard(shards: Sequence[str], auth: InternalAuth, worker_id: str, address: str,
                       registration: Awaitable[None], rebalancing: Rebalancing | None,
                       stop: asyncio.Event) -> str | None:
    """Stays registered at `address` until the registration ends (None) or the worker is
    to move (the shard to move to; the registration is then stopped)."""
    registered = asyncio.ensure_future(registration)
    if rebalancing is None or rebalancing.every_s <= 0:
        await registered
        return None
    watch = asyncio.create_task(_watch_balance(shards, auth, worker_id, address, rebalancing.every_s, stop))
    try:
        await asyncio.wait((registered, watch), return_when=asyncio.FIRST_COMPLETED)
        return watch.result() if watch.done() and not registered.done() else None
    finally:
        for task in (registered, watch):
            task.cancel()
        await asyncio.gather(registered, watch, return_exceptions=True)


async def _watch_balance(shards: Sequence[str], auth: InternalAuth, worker_id: str, current: str,
                         every_s: float, stop: asyncio.Event) -> str | None:
    """Looks at the shards' workers every `every_s` until this worker is to move; returns
    where (None once `stop` is set)."""
    while True:
        try:
            await asyncio.wait_for(stop.wait(), timeout=every_s)
            return None
        except TimeoutError:
            pass
        target = shard_to_move_to(await _workers_by_shard(shards, auth), current, worker_id)
        if target is not None:
            return target


async def _workers_by_shard(shards: Sequence[str], auth: InternalAuth) -> dict[str, list[str] | None]:
    """Every shard's registered worker ids (None where it did not answer), asked at once."""
    answers = await asyncio.gather(*(_workers_at(address, auth) for address in shards))
    return dict(zip(shards, answers))


async def _workers_at(address: str, auth: InternalAuth) -> list[str] | None:
    channel = internal_channel(address, auth)
    try:
        stats = await scheduler_pb2_grpc.SchedulerStub(channel).Stats(common_pb2.StatsRequest(),
                                                                       timeout=ASK_TIMEOUT_S)
        return [worker.worker_id for worker in stats.workers]
    except grpc.aio.AioRpcError:
        return None
    finally:
        await channel.close()
