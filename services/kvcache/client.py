"""The one client of the KvIndex service, for the other services: the workers publish their
block events and ask for resyncs, the scheduler looks prompts up to route them, the gateway
asks for the index's stats. RPC failures are raised as they come (grpc.aio.AioRpcError): each
caller decides what a failure means to it."""

from __future__ import annotations

from collections.abc import Sequence

import grpc
from fairserve.v1 import common_pb2, kvindex_pb2, kvindex_pb2_grpc

from common.transport.grpc_server import internal_channel, request_metadata
from common.transport.internal_auth import InternalAuth
from services.kvcache import convert
from services.kvcache.kv_types import (
    IndexStats, LookupQuery, LookupResult, PublishBatch, PublishResult, RecordedLookup,
)


class KvIndexClient:
    """Every call has the client's deadline (`timeout_s`). `stub` stands in for the channel's
    stub in tests."""

    def __init__(self, channel: grpc.aio.Channel | None, timeout_s: float = 2.0,
                 stub: kvindex_pb2_grpc.KvIndexStub | None = None) -> None:
        self._channel = channel
        self._stub = stub if stub is not None else kvindex_pb2_grpc.KvIndexStub(channel)
        self._timeout_s = timeout_s

    @classmethod
    def connect(cls, address: str, timeout_s: float = 2.0,
                auth: InternalAuth = InternalAuth()) -> "KvIndexClient":
        return cls(internal_channel(address, auth), timeout_s)

    async def publish(self, batch: PublishBatch) -> PublishResult:
        reply = await self._stub.Publish(convert.publish_to_proto(batch), timeout=self._timeout_s)
        return convert.publish_result_from_proto(reply)

    async def lookup_tokens(self, token_ids: Sequence[int], request_id: str | None = None,
                            cache_salt: str = "") -> LookupResult:
        request = kvindex_pb2.LookupRequest(token_ids=token_ids, cache_salt=cache_salt)
        reply = await self._stub.Lookup(request, timeout=self._timeout_s,
                                        metadata=request_metadata(request_id))
        return convert.lookup_result_from_proto(reply)

    async def lookup_many(self, queries: Sequence[tuple[Sequence[int], str]],
                          request_ids: Sequence[str] = ()) -> list[LookupResult | None]:
        """Token lookups, each (token ids, cache salt), in one call (LookupMany).

        Args:
            queries: at most the index's MAX_LOOKUPS_PER_CALL.
            request_ids: the request each query is for, for the index's logs (aligned, or empty).

        Returns:
            Each query's result, aligned with them; None for a query the index refused.
        """
        request = kvindex_pb2.LookupManyRequest(
            queries=[kvindex_pb2.LookupRequest(token_ids=token_ids, cache_salt=salt) for token_ids, salt in queries],
            request_ids=request_ids)
        reply = await self._stub.LookupMany(request, timeout=self._timeout_s)
        return [None if result.error else convert.lookup_result_from_proto(result) for result in reply.results]

    async def record_lookups(self, lookups: Sequence[RecordedLookup]) -> None:
        """Lookups that were not asked, counted after the fact (RecordLookups; at most the
        index's MAX_LOOKUPS_PER_CALL a call)."""
        request = kvindex_pb2.RecordLookupsRequest(lookups=[convert.recorded_lookup_to_proto(lookup)
                                                            for lookup in lookups])
        await self._stub.RecordLookups(request, timeout=self._timeout_s)

    async def lookup(self, query: LookupQuery, request_id: str | None = None) -> LookupResult:
        request = kvindex_pb2.LookupRequest(block_hashes=query.block_hashes,
                                            partial_hash=query.partial_hash,
                                            partial_tokens=query.partial_tokens)
        reply = await self._stub.Lookup(request, timeout=self._timeout_s,
                                        metadata=request_metadata(request_id))
        return convert.lookup_result_from_proto(reply)

    async def stats(self) -> IndexStats:
        reply = await self._stub.Stats(common_pb2.StatsRequest(), timeout=self._timeout_s)
        return convert.stats_from_proto(reply)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
