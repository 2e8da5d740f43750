"""The gateway's gRPC client for the scheduler (and the kvcache service,
which it only probes for readiness and stats)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc

from common.grpc_server import check_health, insecure_channel, request_metadata
from fairserve.v1 import (
    common_pb2,
    kvindex_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from services.gateway import convert
from services.gateway.backend import (
    BackendError,
    GenerationEvent,
    GenerationRequest,
    Readiness,
    SchedulerView,
    Unavailable,
)

log = logging.getLogger(__name__)
PROBE_TIMEOUT_S = 2.0


class SchedulerClient:
    def __init__(self, scheduler_addr: str, kvcache_addr: str) -> None:
        self._scheduler_channel = insecure_channel(scheduler_addr)
        self._kvcache_channel = insecure_channel(kvcache_addr)
        self._scheduler = scheduler_pb2_grpc.SchedulerStub(self._scheduler_channel)
        self._kvcache = kvindex_pb2_grpc.KvIndexStub(self._kvcache_channel)
        self._max_model_len: int | None = None

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        call = self._scheduler.Generate(
            convert.generate_request_to_proto(request),
            metadata=request_metadata(request.trace_id or request.request_id),
        )
        try:
            async for message in call:
                yield convert.event_from_proto(message)
        except grpc.aio.AioRpcError as error:
            raise convert.backend_error_from_rpc(error) from None
        finally:
            # Closing the stream early (client gone, stop string) cancels the
            # RPC, which the scheduler turns into a cancelled request.
            call.cancel()

    async def cancel(self, request_id: str) -> bool:
        try:
            reply = await self._scheduler.Cancel(
                scheduler_pb2.CancelRequest(request_id=request_id), timeout=PROBE_TIMEOUT_S,
                metadata=request_metadata(request_id))
        except grpc.aio.AioRpcError as error:
            log.warning("cancel failed", extra={"error": error.code().name})
            return False
        return reply.found

    async def scheduler_stats(self) -> SchedulerView:
        try:
            reply = await self._scheduler.Stats(common_pb2.StatsRequest(), timeout=PROBE_TIMEOUT_S)
        except grpc.aio.AioRpcError as error:
            raise Unavailable(f"scheduler did not answer: {error.code().name}") from None
        return convert.scheduler_view_from_proto(reply)

    async def kvcache_stats(self) -> dict[str, Any]:
        try:
            reply = await self._kvcache.Stats(common_pb2.StatsRequest(), timeout=PROBE_TIMEOUT_S)
        except grpc.aio.AioRpcError as error:
            raise Unavailable(f"kvcache did not answer: {error.code().name}") from None
        return convert.kvcache_stats_to_dict(reply)

    async def readiness(self) -> Readiness:
        try:
            view = await self.scheduler_stats()
        except BackendError as error:
            return Readiness(False, error.message)
        if view.healthy_workers < 1:
            return Readiness(False, "no healthy worker is registered with the scheduler")
        if not await check_health(self._kvcache_channel, timeout_s=PROBE_TIMEOUT_S):
            return Readiness(False, "kvcache service is not serving")
        return Readiness(True)

    async def max_model_len(self) -> int | None:
        if self._max_model_len is None:
            self._max_model_len = await self._ask_workers_max_model_len()
        return self._max_model_len

    async def _ask_workers_max_model_len(self) -> int | None:
        try:
            view = await self.scheduler_stats()
        except BackendError:
            return None
        for worker in view.workers:
            if not worker.healthy or not worker.address:
                continue
            async with insecure_channel(worker.address) as channel:
                try:
                    info = await worker_pb2_grpc.WorkerStub(channel).Info(
                        worker_pb2.InfoRequest(), timeout=PROBE_TIMEOUT_S)
                except grpc.aio.AioRpcError:
                    continue
            if info.max_model_len > 0:
                return info.max_model_len
        return None

    async def close(self) -> None:
        await self._scheduler_channel.close()
        await self._kvcache_channel.close()
