"""The responses this gateway keeps: each one's owner (the tenant that created
it; "" without API keys), its response object as it stands, every event it
streamed, numbered from 0 (sequence_number), and the generation filling it.
A reader that is not the owner gets nothing, as if the id did not exist (a
404, so ids are not confirmed). A finished response expires RESPONSES_TTL_S
after it ended; each tenant keeps at most RESPONSES_MAX_PER_TENANT, in
progress or stored.

Kept in this process; a background response is also held by the scheduler,
from which another gateway adopts it (docs/architecture.md). The clock is
injected."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from services.gateway.responses.events import ResponseBuilder


@dataclass(eq=False)
class ResponseRecord:
    owner: str
    builder: ResponseBuilder
    conversation: list[dict[str, Any]]     # the chat messages it answered (instructions left out)
    background: bool
    store: bool
    events: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False
    ended_at: float | None = None
    task: asyncio.Task[None] | None = None
    failure: Exception | None = None       # what ended it before its first output, to be the HTTP error
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def response_id(self) -> str:
        return self.builder.response_id

    def add(self, events: list[dict[str, Any]]) -> None:
        """Numbers and keeps `events`; wakes the readers."""
        for event in events:
            event["sequence_number"] = len(self.events)
            self.events.append(event)
        self._wake()

    def end(self, now: float) -> None:
        self.done, self.ended_at = True, now
        self._wake()

    async def follow(self, after: int = -1) -> AsyncIterator[dict[str, Any]]:
        """Every event numbered past `after`, as they come, until the response ends."""
        position = max(after + 1, 0)
        while True:
            while position < len(self.events):
                yield self.events[position]
                position += 1
            if self.done:
                return
            changed = self._changed
            await changed.wait()

    def _wake(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()


class TooManyResponses(Exception):
    """The tenant keeps RESPONSES_MAX_PER_TENANT responses already."""


class ResponseStore:
    def __init__(self, ttl_s: float, max_per_tenant: int, clock: Callable[[], float]) -> None:
        self._ttl_s = ttl_s
        self._max_per_tenant = max_per_tenant
        self._clock = clock
        self._records: dict[str, ResponseRecord] = {}

    def add(self, record: ResponseRecord) -> None:
        """Keeps a new response; TooManyResponses past its tenant's count."""
        self.expire()
        held = sum(1 for r in self._records.values() if r.owner == record.owner)
        if held >= self._max_per_tenant:
            raise TooManyResponses(f"{held} responses are kept for this tenant "
                                   f"(RESPONSES_MAX_PER_TENANT={self._max_per_tenant}); delete some or "
                                   f"wait for them to expire (RESPONSES_TTL_S={self._ttl_s:g})")
        self._records[record.response_id] = record

    def get(self, response_id: str, owner: str) -> ResponseRecord | None:
        """The response, for its owner only; None for anyone else or an unknown id."""
        self.expire()
        record = self._records.get(response_id)
        return record if record is not None and record.owner == owner else None

    def remove(self, response_id: str) -> None:
        self._records.pop(response_id, None)

    def ended(self, record: ResponseRecord) -> None:
        """A response has ended: one not to be stored goes now."""
        record.end(self._clock())
        if not record.store:
            self.remove(record.response_id)

    def expire(self) -> None:
        now = self._clock()
        for response_id, record in list(self._records.items()):
            if record.ended_at is not None and now - record.ended_at >= self._ttl_s:
                del self._records[response_id]

    def __len__(self) -> int:
        return len(self._records)
