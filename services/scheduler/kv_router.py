"""The scheduler's view of the KV index: prefix lookups for routing, each
with a short deadline, and whether the index is answering (a gauge). The calls go
through the kvcache's own client (services/kvcache/client.py)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import grpc

from common.transport.internal_auth import InternalAuth
from services.kvcache.client import KvIndexClient

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
                 client: KvIndexClient | None = None, auth: InternalAuth = InternalAuth(),
                 on_availability: Callable[[bool], None] | None = None) -> None:
        self._address = address
        self._auth = auth
        self._clock = clock
        self._client = client
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
            result = await self._lookup_client().lookup_tokens(token_ids, request_id, cache_salt)
        except grpc.aio.AioRpcError as error:
            self._on_failure(error.code())
            return {}
        self._missed_deadlines = 0
        if not self.available:
            log.info("kv index lookups answer again", extra={"kvcache_addr": self._address})
            self._set_available(True)
        return {match.worker_id: match.matched_tokens for match in result.matches}

    def _lookup_client(self) -> KvIndexClient:
        if self._client is None:   # made on first use, on the scheduler's loop
            self._client = KvIndexClient.connect(self._address, KV_LOOKUP_TIMEOUT_S, self._auth)
        return self._client

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
        if self._client is not None:
            await self._client.close()
