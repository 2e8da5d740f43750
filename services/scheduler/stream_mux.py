"""One GenerateMany call's book-keeping: which stream numbers name which requests, and
the events waiting to be written.

A gateway keeps one GenerateMany call open and runs all its requests over it, so the
scheduler writes one message per moment of progress (every token every request made
since the last write) instead of one message on one HTTP/2 stream per token of each
request, and wakes one writer instead of a coroutine per request.

    gateway                                   scheduler
    submit(stream=7, request) ───────────►    admit → request_id "r7"
    submit(stream=8, request) ───────────►    admit → request_id "r8"
                                              step: r7 +1 token, r8 +1 token
    ◄─────────── StreamEvents[(7, token), (8, token)]   one message
    cancel(stream=8) ────────────────────►    r8 cancelled

Stream numbers are the caller's; a request id is the scheduler's. Invariants: a stream
is `admitting` (its submit is being admitted), then `open` (mapped to its request id)
until it ends; an ended stream's number may be used again. Events are kept in the order
they were put, so a request's events stay in order."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from services.scheduler.core.types import RequestUpdate


class StreamInUse(Exception):
    """A submit named a stream still open on its call: the caller broke the protocol."""


@dataclass
class OpenStream:
    request_id: str
    detached: bool
    trace_id: str = ""      # the gateway's request id, for the logs
    packed: bool = False    # its GenerateRequest.packed_tokens


@dataclass
class StreamConnection:
    admitting: set[int] = field(default_factory=set)
    open: dict[int, OpenStream] = field(default_factory=dict)
    # Streams whose cancel came while they were still being admitted.
    cancelled_early: set[int] = field(default_factory=set)
    pending: list[tuple[int, RequestUpdate]] = field(default_factory=list)
    ready: asyncio.Event = field(default_factory=asyncio.Event)

    def in_use(self, stream: int) -> bool:
        return stream in self.admitting or stream in self.open

    def begin(self, stream: int) -> None:
        self.admitting.add(stream)

    def opened(self, stream: int, request_id: str, detached: bool, trace_id: str = "",
               packed: bool = False) -> bool:
        """Maps an admitted stream to its request. Returns False when its caller
        cancelled it meanwhile (the request is to be ended at once)."""
        self.admitting.discard(stream)
        self.open[stream] = OpenStream(request_id, detached, trace_id, packed)
        if stream in self.cancelled_early:
            self.cancelled_early.discard(stream)
            return False
        return True

    def refused(self, stream: int) -> None:
        self.admitting.discard(stream)
        self.cancelled_early.discard(stream)

    def cancel(self, stream: int) -> OpenStream | None:
        """The caller left `stream`: its open request (to be cancelled), or None when
        it is still being admitted (then it ends once admitted) or unknown."""
        if stream in self.admitting:
            self.cancelled_early.add(stream)
            return None
        return self.open.pop(stream, None)

    def close(self, stream: int) -> None:
        self.open.pop(stream, None)

    def put(self, stream: int, update: RequestUpdate) -> None:
        self.pending.append((stream, update))
        self.ready.set()

    def take(self) -> list[tuple[int, RequestUpdate]]:
        """Every event waiting, oldest first; the connection is left empty."""
        taken, self.pending = self.pending, []
        self.ready.clear()
        return taken
