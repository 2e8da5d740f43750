"""The scheduler's view of the KV index: prefix lookups for routing, each
with a short deadline, and whether the index is answering (a gauge). The calls go
through the kvcache's own client (services/kvcache/client.py).

Lookups asked while a call is out wait for it and go together in the next one
(LookupMany): a lone lookup goes at once, and a burst of arrivals costs the index a
call per batch, not one each (4,096 admissions at once used to time out together
and turn cache-aware routing off for everything that followed)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from common.transport.internal_auth import InternalAuth
from services.kvcache.client import KvIndexClient
from services.kvcache.kv_types import RecordedLookup
from services.scheduler.lookup_records import Record

log = logging.getLogger(__name__)

KV_LOOKUP_TIMEOUT_S = 0.25
KV_RETRY_AFTER_S = 5.0
KV_MISSED_DEADLINES_BEFORE_PAUSE = 3
# A LookupMany call's most queries and prompt tokens (the index hashes every token it is sent).
LOOKUPS_PER_CALL = 256
LOOKUP_TOKENS_PER_CALL = 65_536


@dataclass
class _Asked:
    token_ids: Sequence[int]
    cache_salt: str
    request_id: str
    answer: asyncio.Future[dict[str, int]]


def _by_worker(result: Any) -> dict[str, int]:
    """worker_id -> cached prefix tokens, from the index's answer (a kvcache LookupResult)."""
    return {match.worker_id: match.matched_tokens for match in result.matches}


def _settle(batch: Sequence[_Asked], answers: Sequence[dict[str, int]]) -> None:
    """Each asked lookup its answer ({} past the answers: routed without the index)."""
    for index, asked in enumerate(batch):
        if not asked.answer.done():     # its admission may have been cancelled meanwhile
            asked.answer.set_result(answers[index] if index < len(answers) else {})


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
        self._many = True                    # False once the index answers LookupMany UNIMPLEMENTED
        self._records = True                 # False once it answers RecordLookups UNIMPLEMENTED
        self._asked: list[_Asked] = []       # waiting for the next LookupMany call
        self._sender: asyncio.Task[None] | None = None

    async def cached_prefix_tokens(self, token_ids: Sequence[int], request_id: str | None = None,
                                   cache_salt: str = "") -> dict[str, int]:
        """worker_id -> cached prefix tokens of `token_ids` under `cache_salt` ({} without the index)."""
        if self._clock() < self._skip_until:
            return {}
        if not self._many:
            return await self._lookup_one(token_ids, request_id, cache_salt)
        answer: asyncio.Future[dict[str, int]] = asyncio.get_running_loop().create_future()
        self._asked.append(_Asked(token_ids, cache_salt, request_id or "", answer))
        if self._sender is None or self._sender.done():
            self._sender = asyncio.ensure_future(self._send_asked())
        return await answer

    async def _send_asked(self) -> None:
        """Sends what is asked, a batch a call, until nothing is. No one asking is left
        waiting, whatever happens: a failure routes them without the index."""
        while self._asked:
            batch = self._next_batch()
            try:
                answers = await self._lookup_batch(batch)
            except asyncio.CancelledError:       # the scheduler stopping
                _settle([*batch, *self._asked], [])
                self._asked.clear()
                raise
            except Exception:                    # a bug must not hold admissions
                log.exception("kv index lookups failed", extra={"kvcache_addr": self._address})
                answers = []
            _settle(batch, answers)

    def _next_batch(self) -> list[_Asked]:
        """The oldest asked lookups, up to a call's queries and tokens (at least one)."""
        count, tokens = 0, 0
        for asked in self._asked:
            tokens += len(asked.token_ids)
            if count == LOOKUPS_PER_CALL or (count and tokens > LOOKUP_TOKENS_PER_CALL):
                break
            count += 1
        batch, self._asked = self._asked[:count], self._asked[count:]
        return batch

    async def _lookup_batch(self, batch: list[_Asked]) -> list[dict[str, int]]:
        if self._clock() < self._skip_until:
            return [{} for _ in batch]
        try:
            results = await self._lookup_client().lookup_many(
                [(asked.token_ids, asked.cache_salt) for asked in batch], [asked.request_id for asked in batch])
        except grpc.aio.AioRpcError as error:
            if error.code() != grpc.StatusCode.UNIMPLEMENTED:
                self._on_failure(error.code())
                return [{} for _ in batch]
            log.info("the kv index predates LookupMany: one call a lookup", extra={"kvcache_addr": self._address})
            self._many = False
            return list(await asyncio.gather(*(self._lookup_one(asked.token_ids, asked.request_id, asked.cache_salt)
                                               for asked in batch)))
        self._answered()
        return [_by_worker(result) if result is not None else {} for result in results]

    async def _lookup_one(self, token_ids: Sequence[int], request_id: str | None, cache_salt: str) -> dict[str, int]:
        try:
            result = await self._lookup_client().lookup_tokens(token_ids, request_id, cache_salt)
        except grpc.aio.AioRpcError as error:
            self._on_failure(error.code())
            return {}
        self._answered()
        return _by_worker(result)

    async def record_lookups(self, records: list[Record]) -> None:
        """Lookups not asked (one worker), counted by the index after the fact
        (lookup_records.py). Skipped while lookups are paused, and for good by an index that
        predates RecordLookups; a failure pauses the index as a lookup's would, and is raised."""
        if self._clock() < self._skip_until or not self._records:
            return
        try:
            await self._lookup_client().record_lookups(
                [RecordedLookup(record.prompt_tokens, record.cached_tokens, record.request_id) for record in records])
        except grpc.aio.AioRpcError as error:
            if error.code() == grpc.StatusCode.UNIMPLEMENTED:
                log.info("the kv index predates RecordLookups: lookups not asked go unrecorded",
                         extra={"kvcache_addr": self._address})
                self._records = False
                return
            self._on_failure(error.code())
            raise
        self._answered()

    def _answered(self) -> None:
        self._missed_deadlines = 0
        if not self.available:
            log.info("kv index lookups answer again", extra={"kvcache_addr": self._address})
            self._set_available(True)

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
