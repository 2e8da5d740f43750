"""The gateway over scheduler shards (SCHEDULER_SHARDS): several schedulers, each serving
its own workers and exchanging their tenants' service for fairness (the scheduler's
SCHEDULER_PEERS; docs/scaling.md). A request goes to its session's shard (its KV cache is
there); else to the shard of the worker the kvcache index says holds the longest cached
prefix of its prompt (the index holds every shard's workers' blocks), unless that shard
is overloaded (more than SHARD_LOAD_SLACK of this gateway's requests in flight above, and
1.5x, the least loaded one); else to the least loaded. A shard whose connection was lost
is passed over for LOST_SHARD_S, so the continuation of a request it held
(continuation.py) resumes on another. Cancels and detached requests go to the shard that
holds them; stats and readiness gather all shards."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from common.block_hash import adapter_id, adapter_salt

from services.gateway.requests.backend import (
    BackendError,
    GenerationEvent,
    GenerationSpec,
    ModelInfo,
    Readiness,
    SchedulerLost,
    SchedulerBackend,
    SchedulerView,
    Unavailable,
)

log = logging.getLogger(__name__)

LOST_SHARD_S = 2.0
REMEMBERED_REQUESTS = 100_000     # request id -> shard, for cancels and attaches
WORKER_MAP_S = 2.0                # how often which worker is on which shard is asked again
SHARD_LOAD_SLACK = 16
INDEX_PAUSE_S = 5.0               # after a failed lookup, place by load alone this long


# The kvcache index's answer for routing: (prompt token ids, request id, cache salt) ->
# worker id -> cached prefix tokens (SchedulerClient.cached_prefix_tokens).
Lookup = Callable[[Sequence[int], str, str], Awaitable[dict[str, int]]]


class ShardedScheduler:
    def __init__(self, shards: Sequence[SchedulerBackend], names: Sequence[str],
                 clock: Callable[[], float] = time.monotonic, index: Lookup | None = None) -> None:
        if len(shards) != len(names) or not shards:
            raise ValueError("one name per shard, at least one shard")
        self._shards = list(shards)
        self._names = list(names)
        self._clock = clock
        self._in_flight = [0] * len(shards)
        self._lost_until = [0.0] * len(shards)
        self._placed: OrderedDict[str, int] = OrderedDict()
        self._index = index
        self._worker_shard: dict[str, int] = {}
        self._map_asked_at = -WORKER_MAP_S
        self._map_task: asyncio.Task[None] | None = None
        self._index_paused_until = 0.0

    @property
    def scheduler_seen(self) -> bool:
        return any(shard.scheduler_seen for shard in self._shards)

    def choose(self, spec: GenerationSpec, cached: Mapping[str, int] | None = None) -> int:
        """The shard for a new request: its session's; else the shard of the worker with the
        longest cached prefix (`cached`: worker id -> tokens, the index's answer) unless it is
        overloaded; else the least loaded reachable one."""
        reachable = [index for index in range(len(self._shards)) if self._lost_until[index] <= self._clock()]
        candidates = reachable or list(range(len(self._shards)))
        sticky = spec.session_id or spec.user
        if sticky:
            digest = hashlib.sha256(f"{spec.client_id}\0{sticky}".encode()).digest()
            preferred = int.from_bytes(digest[:8], "big") % len(self._shards)
            if preferred in candidates:
                return preferred
        least = min(candidates, key=lambda index: (self._in_flight[index], index))
        holders = sorted(((tokens, worker) for worker, tokens in (cached or {}).items()
                          if self._worker_shard.get(worker) in candidates and tokens > 0), reverse=True)
        if holders:
            shard = self._worker_shard[holders[0][1]]
            lightest = self._in_flight[least]
            if self._in_flight[shard] <= max(lightest + SHARD_LOAD_SLACK, 1.5 * lightest):
                return shard
        return least

    async def _place(self, spec: GenerationSpec, request_id: str) -> tuple[int, GenerationSpec]:
        """`choose`, with the index asked where the prompt is cached (not for a session's
        request, nor while the index does not answer); the spec carries the index's answer
        on to the shard, which then routes among its workers without asking again."""
        self._refresh_worker_map()
        cached: dict[str, int] | None = None
        if (self._index is not None and self._worker_shard and not (spec.session_id or spec.user)
                and self._clock() >= self._index_paused_until):
            salt = adapter_salt(spec.cache_salt, adapter_id(spec.lora_name, spec.lora_digest))
            try:
                cached = await self._index(spec.prompt_token_ids, request_id, salt)
            except Unavailable as error:
                self._index_paused_until = self._clock() + INDEX_PAUSE_S
                log.warning("kv index lookup failed; placing requests by load for a while",
                            extra={"error": str(error), "pause_s": INDEX_PAUSE_S})
        shard = self.choose(spec, cached)
        if cached is not None:
            spec = replace(spec, index_answer=tuple(sorted(cached.items())))
        return shard, spec

    def _refresh_worker_map(self) -> None:
        if self._clock() - self._map_asked_at < WORKER_MAP_S or (self._map_task and not self._map_task.done()):
            return
        self._map_asked_at = self._clock()
        self._map_task = asyncio.create_task(self._ask_worker_map())

    async def _ask_worker_map(self) -> None:
        answers = await asyncio.gather(*(client.scheduler_stats() for client in self._shards),
                                       return_exceptions=True)
        mapping = dict(self._worker_shard)
        for shard, answer in enumerate(answers):
            if isinstance(answer, SchedulerView):
                mapping = {worker: owner for worker, owner in mapping.items() if owner != shard}
                mapping.update({worker.worker_id: shard for worker in answer.workers})
        self._worker_shard = mapping

    async def generate(self, spec: GenerationSpec, request_id: str,
                       trace_id: str = "") -> AsyncIterator[GenerationEvent]:
        shard = self._placed.get(request_id) if spec.attach else None
        if shard is None:
            shard, spec = await self._place(spec, request_id)
        self._remember(request_id, shard)
        self._in_flight[shard] += 1
        try:
            async for event in self._shards[shard].generate(spec, request_id, trace_id):
                yield event
        except SchedulerLost:
            self._lost_until[shard] = self._clock() + LOST_SHARD_S
            raise
        finally:
            self._in_flight[shard] -= 1

    async def cancel(self, request_id: str) -> bool:
        shard = self._placed.get(request_id)
        if shard is not None:
            return await self._shards[shard].cancel(request_id)
        return any(await asyncio.gather(*(client.cancel(request_id) for client in self._shards)))

    async def detached(self, request_id: str, client_id: str) -> GenerationSpec | None:
        for index, client in enumerate(self._shards):
            try:
                spec = await client.detached(request_id, client_id)
            except BackendError:
                continue        # that shard is out of reach; another may hold it
            if spec is not None:
                self._remember(request_id, index)
                return spec
        return None

    async def scheduler_stats(self) -> SchedulerView:
        """Every shard's workers and counts together; raises when no shard answers."""
        answers = await asyncio.gather(*(client.scheduler_stats() for client in self._shards),
                                       return_exceptions=True)
        views = [answer for answer in answers if isinstance(answer, SchedulerView)]
        if not views:
            raise next(answer for answer in answers if isinstance(answer, BaseException))
        return merged_view(views, [name for name, answer in zip(self._names, answers)
                                   if isinstance(answer, SchedulerView)], self._names)

    async def kvcache_stats(self) -> dict[str, Any]:
        return await self._shards[0].kvcache_stats()     # one index for all shards

    async def readiness(self) -> Readiness:
        """Ready while a shard serves with a healthy worker; each shard named in the
        dependencies, so one down shows the gateway degraded."""
        answers = await asyncio.gather(*(client.readiness() for client in self._shards))
        dependencies = tuple((f"scheduler {name}", answer.ready) for name, answer in zip(self._names, answers))
        kvcache = tuple(dep for dep in answers[0].dependencies if dep[0] == "kvcache")
        ready = [answer for answer in answers if answer.ready]
        reason = "" if ready else "; ".join(f"{name}: {answer.reason}" for name, answer in zip(self._names, answers))
        return Readiness(bool(ready), reason, dependencies + kvcache)

    async def model_info(self) -> ModelInfo:
        for client in self._shards:
            info = await client.model_info()
            if info.known:
                return info
        return ModelInfo()

    async def close(self) -> None:
        if self._map_task is not None:
            self._map_task.cancel()
        for client in self._shards:
            await client.close()

    def _remember(self, request_id: str, shard: int) -> None:
        self._placed[request_id] = shard
        self._placed.move_to_end(request_id)
        while len(self._placed) > REMEMBERED_REQUESTS:
            self._placed.popitem(last=False)


def merged_view(views: Sequence[SchedulerView], answered: Sequence[str], names: Sequence[str]) -> SchedulerView:
    """One view of several shards: their workers, summed counts, each tenant's tokens
    served on all of them, and which shards answered."""
    details: dict[str, Any] = dict(views[0].details)
    for view in views[1:]:
        for key, value in view.details.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key in details:
                details[key] = details[key] + value
            elif isinstance(value, dict) and isinstance(details.get(key), dict):
                details[key] = {k: details[key].get(k, 0) + value.get(k, 0) for k in {*details[key], *value}}
            elif isinstance(value, list) and key == "workers":
                details[key] = [*details[key], *value]
    clients: dict[str, dict[str, Any]] = {}
    for view in views:
        for client in view.details.get("clients", []):
            merged = clients.setdefault(client["client_id"], {**client, "served_tokens": 0})
            merged["served_tokens"] += client["served_tokens"]
            merged["counter"] = max(merged["counter"], client["counter"])
    details["clients"] = list(clients.values())
    details["shards"] = {name: name in answered for name in names}
    return SchedulerView(
        workers=tuple(worker for view in views for worker in view.workers), details=details,
        waiting_for_worker=sum(view.waiting_for_worker for view in views),
        worker_wait_s=max(view.worker_wait_s for view in views),
        worker_recovery_s=views[0].worker_recovery_s)
