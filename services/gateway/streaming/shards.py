"""The gateway over scheduler shards (SCHEDULER_SHARDS): several schedulers, each serving
its own workers and exchanging their tenants' service for fairness (the scheduler's
SCHEDULER_PEERS; docs/scaling.md). A request goes to its session's shard (its KV cache is
there), else to the shard with the fewest of this gateway's requests in flight; a shard
whose connection was lost is passed over for LOST_SHARD_S, so the continuation of a
request it held (continuation.py) resumes on another. Cancels and detached requests go
to the shard that holds them; stats and readiness gather all shards."""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from services.gateway.requests.backend import (
    BackendError,
    GenerationEvent,
    GenerationSpec,
    ModelInfo,
    Readiness,
    SchedulerLost,
    SchedulerView,
)
from services.gateway.streaming.scheduler_client import SchedulerClient

LOST_SHARD_S = 2.0
REMEMBERED_REQUESTS = 100_000     # request id -> shard, for cancels and attaches


class ShardedScheduler:
    def __init__(self, shards: Sequence[SchedulerClient], names: Sequence[str],
                 clock: Callable[[], float] = time.monotonic) -> None:
        if len(shards) != len(names) or not shards:
            raise ValueError("one name per shard, at least one shard")
        self._shards = list(shards)
        self._names = list(names)
        self._clock = clock
        self._in_flight = [0] * len(shards)
        self._lost_until = [0.0] * len(shards)
        self._placed: OrderedDict[str, int] = OrderedDict()

    @property
    def scheduler_seen(self) -> bool:
        return any(shard.scheduler_seen for shard in self._shards)

    def choose(self, spec: GenerationSpec) -> int:
        """The shard for a new request: its session's, else the least loaded reachable one."""
        reachable = [index for index in range(len(self._shards)) if self._lost_until[index] <= self._clock()]
        candidates = reachable or list(range(len(self._shards)))
        sticky = spec.session_id or spec.user
        if sticky:
            digest = hashlib.sha256(f"{spec.client_id}\0{sticky}".encode()).digest()
            preferred = int.from_bytes(digest[:8], "big") % len(self._shards)
            if preferred in candidates:
                return preferred
        return min(candidates, key=lambda index: (self._in_flight[index], index))

    async def generate(self, spec: GenerationSpec, request_id: str,
                       trace_id: str = "") -> AsyncIterator[GenerationEvent]:
        shard = self._placed.get(request_id) if spec.attach else None
        if shard is None:
            shard = self.choose(spec)
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
