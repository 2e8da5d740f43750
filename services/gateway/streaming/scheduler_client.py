"""The gateway's gRPC client for the scheduler (and the kvcache service, which it only asks for
its stats, as a probe too, through the kvcache's own client: services/kvcache/client.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
from opentelemetry import trace

from common.transport.grpc_server import internal_channel, request_metadata
from common.transport.internal_auth import InternalAuth
from common.observability.tracing import traceparent, traceparent_metadata, tracer
from fairserve.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from services.gateway import convert
from services.kvcache.client import KvIndexClient
from services.gateway.streaming.scheduler_streams import SchedulerStreams
from services.gateway.requests.backend import (
    BackendError,
    GenerationEvent,
    GenerationSpec,
    ModelInfo,
    Readiness,
    SchedulerView,
    Unavailable,
)

log = logging.getLogger(__name__)
PROBE_TIMEOUT_S = 2.0
LOOKUP_TIMEOUT_S = 0.25     # a prefix lookup for routing: past it, the request goes by load


class SchedulerClient:
    """`multiplexed`: requests go over one GenerateMany call (scheduler_streams.py), else
    a Generate call each (SCHEDULER_STREAM)."""

    def __init__(self, scheduler_addr: str, kvcache_addr: str, auth: InternalAuth = InternalAuth(),
                 multiplexed: bool = True) -> None:
        self._scheduler_channel = internal_channel(scheduler_addr, auth)
        self._scheduler = scheduler_pb2_grpc.SchedulerStub(self._scheduler_channel)
        self._streams = SchedulerStreams(self._scheduler, self._seen) if multiplexed else None
        self._kvcache = KvIndexClient.connect(kvcache_addr, PROBE_TIMEOUT_S, auth)
        self._kvcache_addr, self._auth = kvcache_addr, auth
        self._lookups: KvIndexClient | None = None     # made on first use (shards.py)
        self._model_info: ModelInfo | None = None  # once fully known, kept
        # Whether the scheduler has answered since the gateway started: only then is
        # a failed connection a lost scheduler worth waiting for (continuation.py).
        self.scheduler_seen = False

    async def generate(self, spec: GenerationSpec, request_id: str,
                       trace_id: str = "") -> AsyncIterator[GenerationEvent]:
        span = tracer().start_span("scheduler.Generate", kind=trace.SpanKind.CLIENT,
                                   attributes={"fairserve.request_id": request_id,
                                               "fairserve.prompt_tokens": len(spec.prompt_token_ids)})
        metadata = (*request_metadata(trace_id or request_id), *traceparent_metadata(span))
        if spec.attach:
            call = self._scheduler.Attach(
                scheduler_pb2.AttachRequest(request_id=request_id, client_id=spec.client_id),
                metadata=metadata)
        elif self._streams is not None:
            call = _StreamCall(self._streams.generate(convert.generate_request_to_proto(spec, request_id),
                                                      trace_id or request_id, traceparent(span)))
        else:
            call = self._scheduler.Generate(
                convert.generate_request_to_proto(spec, request_id), metadata=metadata)
        try:
            skip = len(spec.resume_token_ids) if spec.attach else 0   # read already, before a loss
            first = True
            async for message in call:
                self.scheduler_seen = True
                if first:
                    first = False
                    if span.is_recording():     # when the scheduler's first answer reached the gateway
                        span.add_event("first_event")
                event = convert.event_from_proto(message)
                if skip:
                    dropped = min(skip, len(event.tokens))
                    skip -= dropped
                    event = dataclasses.replace(event, tokens=event.tokens[dropped:], prompt_logprobs=())
                    if not event.tokens and event.finish is None:
                        continue
                yield event
        except grpc.aio.AioRpcError as error:
            raise convert.backend_error_from_rpc(error) from None
        finally:
            # Closing the stream early (client gone, stop string) cancels the
            # RPC, which the scheduler turns into a cancelled request.
            await call.cancel() if isinstance(call, _StreamCall) else call.cancel()
            span.end()

    def _seen(self) -> None:
        self.scheduler_seen = True

    async def cancel(self, request_id: str) -> bool:
        try:
            reply = await self._scheduler.Cancel(
                scheduler_pb2.CancelRequest(request_id=request_id), timeout=PROBE_TIMEOUT_S,
                metadata=request_metadata(request_id))
        except grpc.aio.AioRpcError as error:
            log.warning("cancel failed", extra={"error": error.code().name})
            return False
        return reply.found

    async def detached(self, request_id: str, client_id: str) -> GenerationSpec | None:
        try:
            reply = await self._scheduler.GetDetached(
                scheduler_pb2.AttachRequest(request_id=request_id, client_id=client_id),
                timeout=PROBE_TIMEOUT_S, metadata=request_metadata(request_id))
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise convert.backend_error_from_rpc(error) from None
        return convert.detached_spec_from_proto(reply)

    async def scheduler_stats(self) -> SchedulerView:
        try:
            reply = await self._scheduler.Stats(common_pb2.StatsRequest(), timeout=PROBE_TIMEOUT_S)
        except grpc.aio.AioRpcError as error:
            raise Unavailable(f"scheduler did not answer: {error.code().name}") from None
        self.scheduler_seen = True
        return convert.scheduler_view_from_proto(reply)

    async def cached_prefix_tokens(self, token_ids: Sequence[int], request_id: str,
                                   cache_salt: str) -> dict[str, int]:
        """worker id -> the cached prefix of `token_ids` under `cache_salt` it holds, from the
        kvcache index (routing between scheduler shards); Unavailable when the index fails."""
        if self._lookups is None:
            self._lookups = KvIndexClient.connect(self._kvcache_addr, LOOKUP_TIMEOUT_S, self._auth)
        try:
            result = await self._lookups.lookup_tokens(token_ids, request_id, cache_salt)
        except grpc.aio.AioRpcError as error:
            raise Unavailable(f"kvcache lookup failed: {error.code().name}") from None
        return {match.worker_id: match.matched_tokens for match in result.matches}

    async def kvcache_stats(self) -> dict[str, Any]:
        try:
            stats = await self._kvcache.stats()
        except grpc.aio.AioRpcError as error:
            raise Unavailable(f"kvcache did not answer: {error.code().name}") from None
        return convert.kvcache_stats_to_dict(stats)

    async def readiness(self) -> Readiness:
        """Needs the scheduler and a healthy worker. The kvcache index is asked
        at the same time for its stats (which fail while its Redis does), and
        only reported: routing goes on without it."""
        scheduler, kvcache = await asyncio.gather(self.scheduler_stats(), self.kvcache_stats(),
                                                  return_exceptions=True)
        dependencies = (("scheduler", not isinstance(scheduler, BaseException)),
                        ("kvcache", not isinstance(kvcache, BaseException)))
        if isinstance(scheduler, BaseException):
            message = scheduler.message if isinstance(scheduler, BackendError) else repr(scheduler)
            return Readiness(False, message, dependencies)
        if scheduler.healthy_workers < 1:
            return Readiness(False, scheduler.not_ready_reason(), dependencies)
        return Readiness(True, "", dependencies)

    async def model_info(self) -> ModelInfo:
        """Asks the scheduler until a worker has registered, then keeps the answer."""
        if self._model_info is not None:
            return self._model_info
        try:
            reply = await self._scheduler.GetModelInfo(scheduler_pb2.ModelInfoRequest(),
                                                       timeout=PROBE_TIMEOUT_S)
        except grpc.aio.AioRpcError as error:
            log.debug("model info unavailable", extra={"error": error.code().name})
            return ModelInfo()
        self.scheduler_seen = True
        info = convert.model_info_from_proto(reply)
        if info.known:
            self._model_info = info
        return info

    async def close(self) -> None:
        if self._streams is not None:
            await self._streams.close()
        await self._scheduler_channel.close()
        await self._kvcache.close()
        if self._lookups is not None:
            await self._lookups.close()


class _StreamCall:
    """A request on the GenerateMany call, read as a Generate call is."""

    def __init__(self, events: AsyncIterator[scheduler_pb2.GenerateEvent]) -> None:
        self._events = events

    def __aiter__(self) -> AsyncIterator[scheduler_pb2.GenerateEvent]:
        return self._events

    async def cancel(self) -> None:
        await self._events.aclose()   # type: ignore[attr-defined]
