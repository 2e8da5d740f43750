"""The scheduler's view of the KV index: prefix lookups for routing, each
with a short deadline, and whether the index is answering (a gauge)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import grpc
from fairserve.v1 import kvindex_pb2, kvindex_pb2_grpc

from common.grpc_server import internal_channel, request_metadata
from common.internal_auth import InternalAuth

from services.scheduler import convert

log = logging.getLogger(__name__)

KV_LOOKUP_TIMEOUT_S = 0.25
KV_RETRY_AFTER_S = 5.0
KV_MISSED_DEADLINES_BEFORE_PAUSE = 3


class KvIndexRouter:
    """Asks the KV index which worker holds the longest cached prefix. A lookup
    that fails routes its request without the index. An unreachable index, or
    several lookups in a row past their deadline, is left alone for a while; one
    slow lookup (a pause on a busy host) is not, so that it does not turn off
    cache-aware routing for everything that follows. `on_availability` hears
    False when lookups pause and True when one answers again."""

    def __init__(self, address: str, clock: Callable[[], float],
                 stub: kvindex_pb2_grpc.KvIndexStub | None = None, auth: InternalAuth = InternalAuth(),
                 on_availability: Callable[[bool], None] | None = None) -> None:
        self._address = address
        self._auth = auth
        self._clock = clock
        self._channel: grpc.aio.Channel | None = None
        self._stub = stub
        self._skip_until = 0.0
        self._missed_deadlines = 0
        self._on_availability = on_availability
        self.available = True

    async def cached_prefix_tokens(self, token_ids: Sequence[int], request_id: str | None = None,
                                   cache_salt: str = "") -> dict[str, int]:
        """worker_id -> cached prefix tokens of `token_ids` under `cache_salt` ({} without the index)."""
        if self._clock() < self._skip_until:
            return {}
        try:
            reply = await self._lookup_stub().Lookup(
                kvindex_pb2.LookupRequest(token_ids=token_ids, cache_salt=cache_salt), timeout=KV_LOOKUP_TIMEOUT_S,
                metadata=request_metadata(request_id))
        except grpc.aio.AioRpcError as error:
            self._on_failure(error.code())
            return {}
        self._missed_deadlines = 0
        if not self.available:
            log.info("kv index lookups answer again", extra={"kvcache_addr": self._address})
            self._set_available(True)
        return convert.cached_prefix_tokens(reply)

    def _lookup_stub(self) -> kvindex_pb2_grpc.KvIndexStub:
        if self._stub is None:
            self._channel = internal_channel(self._address, self._auth)
            self._stub = kvindex_pb2_grpc.KvIndexStub(self._channel)
        return self._stub

    def _on_failure(self, code: grpc.StatusCode) -> None:
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            self._missed_deadlines += 1
            if self._missed_deadlines < KV_MISSED_DEADLINES_BEFORE_PAUSE:
                log.info("kv index lookup timed out; routing this request without it",
                         extra={"kvcache_addr": self._address})
                return
        self._missed_deadlines = 0
        self._skip_until = self._clock() + KV_RETRY_AFTER_S
        log.warning("kv index lookups failing; routing without the index for a while",
                    extra={"kvcache_addr": self._address, "code": code.name, "pause_s": KV_RETRY_AFTER_S})
        self._set_available(False)

    def _set_available(self, available: bool) -> None:
        self.available = available
        if self._on_availability is not None:
            self._on_availability(available)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
