"""Lookups the scheduler did not ask the KV index, recorded after the fact.

With one worker there is nothing to route, so the scheduler does not look a prompt up before
admitting it: the call cost ~1.6 ms of CPU a request (the index's and the scheduler's), run
on the same cores as the step it would have routed (a cached 1.5k-token prompt's first token
came ~1.3 ms later for it). The index's hit rate and its log line for the request still come:
when the request ends, what its worker took from the prefix cache (its usage's cached tokens)
is put here, and the records go to the index together (RecordLookups) every `interval_s`.

    admit r7 (one worker: no lookup)  ... r7 ends: 1,496 prompt tokens, 1,486 cached
    add(1496, 1486, "req-7") ──► pending ──(every interval_s)──► send([...]) ──► the index

Records are statistics: a batch the index refuses or cannot take is logged and dropped, and
at most `max_pending` wait (the oldest go first past that)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

RECORDS_PER_CALL = 1024    # the index's MAX_LOOKUPS_PER_CALL


@dataclass(frozen=True)
class Record:
    prompt_tokens: int
    cached_tokens: int
    request_id: str


@dataclass
class LookupRecords:
    send: Callable[[list[Record]], Awaitable[None]]
    interval_s: float = 0.5
    max_pending: int = 4096
    pending: list[Record] = field(default_factory=list)
    dropped: int = 0

    def add(self, prompt_tokens: int, cached_tokens: int, request_id: str) -> None:
        if len(self.pending) >= self.max_pending:
            self.pending.pop(0)
            self.dropped += 1
        self.pending.append(Record(prompt_tokens, min(max(cached_tokens, 0), prompt_tokens), request_id))

    async def flush(self) -> None:
        """Sends what is pending, RECORDS_PER_CALL a call; a failed call's records are dropped."""
        while self.pending:
            batch, self.pending = self.pending[:RECORDS_PER_CALL], self.pending[RECORDS_PER_CALL:]
            try:
                await self.send(batch)
            except asyncio.CancelledError:
                raise
            except Exception as error:       # statistics: never worth holding anything up
                self.dropped += len(batch)
                log.warning("recording lookups in the kv index failed", extra={"records": len(batch),
                                                                              "error": repr(error)})

    async def run(self) -> None:
        """Flushes every `interval_s` until cancelled."""
        while True:
            await asyncio.sleep(self.interval_s)
            await self.flush()
