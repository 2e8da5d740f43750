"""Detached requests (a background /v1/responses response): requests that
outlive the call that sent them. The scheduler keeps each one's request as
sent (opaque here), every update it streamed, and whether it has ended, so
that any gateway (another replica, or the same one after a restart) can read
it again from its first event and follow it to its end. An ended one is
forgotten `ttl_s` after it ended. A reader names its client: a request that
was authenticated is shown to its own client only, anyone else is told it
does not exist.

No transport: the server feeds it updates and streams what it reads."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from services.scheduler.core.types import RequestUpdate


@dataclass(eq=False)
class DetachedRequest:
    request: object                  # as sent (the transport's message)
    client_id: str
    authenticated: bool
    updates: list[RequestUpdate] = field(default_factory=list)
    ended_at: float | None = None
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    def wake(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()


class DetachedLog:
    def __init__(self, ttl_s: float, clock: Callable[[], float]) -> None:
        self._ttl_s = ttl_s
        self._clock = clock
        self._requests: dict[str, DetachedRequest] = {}

    def open(self, request_id: str, request: object, client_id: str, authenticated: bool) -> None:
        self.expire()
        self._requests[request_id] = DetachedRequest(request, client_id, authenticated)

    def note(self, update: RequestUpdate) -> None:
        """Keeps an update of a detached request (others are ignored)."""
        entry = self._requests.get(update.request_id)
        if entry is None or entry.ended_at is not None:
            return
        entry.updates.append(update)
        if update.finish is not None or update.rejection is not None:
            entry.ended_at = self._clock()
        entry.wake()

    def drop(self, request_id: str) -> None:
        """Forgets a request refused at once (it never ran)."""
        self._requests.pop(request_id, None)

    def get(self, request_id: str, client_id: str) -> DetachedRequest | None:
        """The request, for its own client (any client's when it was not authenticated)."""
        self.expire()
        entry = self._requests.get(request_id)
        if entry is None or (entry.authenticated and entry.client_id != client_id):
            return None
        return entry

    async def follow(self, entry: DetachedRequest) -> AsyncIterator[RequestUpdate]:
        """Every update from the first, then as they come, until the request ends."""
        position = 0
        while True:
            while position < len(entry.updates):
                yield entry.updates[position]
                position += 1
            if entry.ended_at is not None:
                return
            changed = entry._changed
            await changed.wait()

    def expire(self) -> None:
        now = self._clock()
        for request_id, entry in list(self._requests.items()):
            if entry.ended_at is not None and now - entry.ended_at >= self._ttl_s:
                del self._requests[request_id]

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests
