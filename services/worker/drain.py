"""The worker's drain on SIGTERM: it tells the scheduler it is leaving
(DrainWorker), which moves its requests to other workers (running ones
resume there by recompute) or, with none, lets it keep serving them. It asks
again every DRAIN_POLL_S (each call also counts as its heartbeat) until
nothing is left on it, the scheduler does not know it or cannot be reached,
DRAIN_TIMEOUT_S has passed or a second stop signal came; then the worker
stops."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from enum import StrEnum

import grpc
from fairserve.v1 import scheduler_pb2, scheduler_pb2_grpc

log = logging.getLogger(__name__)
DRAIN_POLL_S = 0.25
CALL_TIMEOUT_S = 5.0


class DrainEnd(StrEnum):
    DRAINED = "drained"            # nothing is left on the worker
    UNKNOWN = "unknown"            # the scheduler does not know the worker
    UNREACHABLE = "unreachable"    # the scheduler did not answer
    TIMEOUT = "timeout"            # DRAIN_TIMEOUT_S passed with requests left
    INTERRUPTED = "interrupted"    # a second stop signal


async def drain(stub: scheduler_pb2_grpc.SchedulerStub, worker_id: str, timeout_s: float,
                interrupted: asyncio.Event, clock: Callable[[], float] = time.monotonic,
                poll_s: float = DRAIN_POLL_S) -> DrainEnd:
    """Asks the scheduler to take over what the worker holds, again until one
    of the ends above; returns which."""
    deadline = clock() + timeout_s
    request = scheduler_pb2.DrainWorkerRequest(worker_id=worker_id)
    while True:
        try:
            reply = await stub.DrainWorker(request, timeout=CALL_TIMEOUT_S)
        except grpc.aio.AioRpcError as error:
            log.warning("scheduler unreachable while draining", extra={"code": error.code().name})
            return DrainEnd.UNREACHABLE
        if not reply.known:
            return DrainEnd.UNKNOWN
        if reply.remaining == 0:
            return DrainEnd.DRAINED
        left_s = deadline - clock()
        if left_s <= 0:
            return DrainEnd.TIMEOUT
        try:
            await asyncio.wait_for(interrupted.wait(), timeout=min(poll_s, left_s))
            return DrainEnd.INTERRUPTED
        except TimeoutError:
            pass


async def leave(channel: grpc.aio.Channel, worker_id: str, timeout_s: float,
                interrupted: asyncio.Event) -> DrainEnd:
    """The drain, logged at its start and end."""
    log.info("worker draining", extra={"worker_id": worker_id, "drain_timeout_s": timeout_s})
    started = time.monotonic()
    end = await drain(scheduler_pb2_grpc.SchedulerStub(channel), worker_id, timeout_s, interrupted)
    log.info("worker drain ended", extra={"worker_id": worker_id, "end": end.value,
                                          "drain_s": round(time.monotonic() - started, 3)})
    return end
