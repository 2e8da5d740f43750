"""The KvIndex gRPC servicer: converts, calls the service, converts back."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator

import grpc
import redis.exceptions
from fairserve.v1 import common_pb2, kvindex_pb2, kvindex_pb2_grpc

from common.observability.logs import request_id_var
from common.transport.grpc_server import GrpcServer, request_id_from
from common.transport.internal_auth import InternalAuth
from services.kvcache import convert
from services.kvcache.service import KvIndexService

log = logging.getLogger(__name__)

SERVICE_NAME = kvindex_pb2.DESCRIPTOR.services_by_name["KvIndex"].full_name
MAX_LOOKUPS_PER_CALL = 1024   # LookupMany


class KvIndexServicer(kvindex_pb2_grpc.KvIndexServicer):
    def __init__(self, service: KvIndexService) -> None:
        self._service = service

    async def Lookup(self, request: kvindex_pb2.LookupRequest,
                     context: grpc.aio.ServicerContext) -> kvindex_pb2.LookupResponse:
        request_id_from(context)
        async with _mapped_errors(context):
            return await self._answer(request)

    async def LookupMany(self, request: kvindex_pb2.LookupManyRequest,
                         context: grpc.aio.ServicerContext) -> kvindex_pb2.LookupManyResponse:
        """Each query answered as Lookup answers it; one refused (bad input) carries its error
        and the others are answered. An unreachable backend fails the call."""
        request_id_from(context)
        if len(request.queries) > MAX_LOOKUPS_PER_CALL:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"at most {MAX_LOOKUPS_PER_CALL} queries a call, got {len(request.queries)}")
        if request.request_ids and len(request.request_ids) != len(request.queries):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_ids must be aligned with queries")
        results = []
        async with _mapped_errors(context):
            for index, query in enumerate(request.queries):
                if request.request_ids:
                    request_id_var.set(request.request_ids[index])
                try:
                    results.append(await self._answer(query))
                except ValueError as error:
                    results.append(kvindex_pb2.LookupResponse(error=str(error)))
        return kvindex_pb2.LookupManyResponse(results=results)

    async def _answer(self, request: kvindex_pb2.LookupRequest) -> kvindex_pb2.LookupResponse:
        """One lookup; ValueError for a query that is not one."""
        if request.token_ids and (request.block_hashes or request.partial_hash):
            raise ValueError("give either token_ids or block_hashes, not both")
        if request.token_ids:
            result = await self._service.lookup_tokens(request.token_ids, request.cache_salt)
        else:
            result = await self._service.lookup(convert.lookup_query_from_proto(request))
        log.info("lookup", extra={
            "tokens": len(request.token_ids) or None, "block_hashes": len(request.block_hashes) or None,
            "matches": {match.worker_id: match.matched_tokens for match in result.matches}})
        return convert.lookup_result_to_proto(result)

    async def RecordLookups(self, request: kvindex_pb2.RecordLookupsRequest,
                            context: grpc.aio.ServicerContext) -> kvindex_pb2.RecordLookupsResponse:
        """Counts lookups a scheduler did not need to ask (KvIndexService.record_lookups); each
        logs as a lookup under its request's id."""
        request_id_from(context)
        if len(request.lookups) > MAX_LOOKUPS_PER_CALL:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"at most {MAX_LOOKUPS_PER_CALL} lookups a call, got {len(request.lookups)}")
        lookups = [convert.recorded_lookup_from_proto(lookup) for lookup in request.lookups]
        async with _mapped_errors(context):
            await self._service.record_lookups(lookups)
        for lookup in lookups:
            request_id_var.set(lookup.request_id or None)
            log.info("lookup", extra={"tokens": lookup.prompt_tokens, "cached_tokens": lookup.cached_tokens,
                                      "recorded": True})
        return kvindex_pb2.RecordLookupsResponse()

    async def Publish(self, request: kvindex_pb2.PublishRequest,
                      context: grpc.aio.ServicerContext) -> kvindex_pb2.PublishResponse:
        request_id_from(context)
        async with _mapped_errors(context):
            result = await self._service.publish(convert.publish_from_proto(request))
            return convert.publish_result_to_proto(result)

    async def Stats(self, request: common_pb2.StatsRequest,
                    context: grpc.aio.ServicerContext) -> kvindex_pb2.KvIndexStats:
        async with _mapped_errors(context):
            return convert.stats_to_proto(await self._service.stats())


@contextlib.asynccontextmanager
async def _mapped_errors(context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
    """Bad input becomes INVALID_ARGUMENT and an unreachable Redis
    UNAVAILABLE, so that callers can tell what is worth retrying."""
    try:
        yield
    except ValueError as error:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as error:
        log.warning("index backend unreachable", extra={"error": str(error)})
        await context.abort(grpc.StatusCode.UNAVAILABLE, f"index backend: {error}")


def build_server(service: KvIndexService, host: str, port: int,
                 auth: InternalAuth = InternalAuth()) -> GrpcServer:
    return GrpcServer([(kvindex_pb2_grpc.add_KvIndexServicer_to_server, KvIndexServicer(service))],
                      [SERVICE_NAME], host, port, auth)
