"""What one slow or greedy HTTP client can hold: its keep-alive timeout and
h11's header size limit, plus what uvicorn lacks:

- a deadline: the request line and headers must arrive within header_timeout_s
  of the connection opening or the previous response ending, else the
  connection is closed (the body's deadline is BodyLimitMiddleware's);
- a cap of its own on connections waiting for a request's headers (new, half
  sent, or idle between keep-alive requests), per client address and in all:
  past it, the oldest waiting connection of that address (of the address with
  the most, past the total) is closed. A flood of half-open connections so
  costs its sender its own oldest ones and never takes the slots of requests
  whose headers arrived: those are limited apart, as requests in flight
  (InFlightLimitMiddleware, GATEWAY_MAX_CONNECTIONS), where uvicorn's
  limit_concurrency counted every open connection.

The server speaks h11, whose limits are configurable, rather than httptools.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from services.gateway.settings import GatewaySettings


class PendingConnections:
    """The connections waiting for a request's headers, by client address,
    oldest first. Pure: add() says which connections to close."""

    def __init__(self, max_total: int, max_per_address: int) -> None:
        self.max_total = max_total
        self.max_per_address = max_per_address
        self._by_address: dict[Hashable, dict[Hashable, None]] = {}
        self._address_of: dict[Hashable, Hashable] = {}

    def __len__(self) -> int:
        return len(self._address_of)

    def count(self, address: Hashable) -> int:
        return len(self._by_address.get(address, ()))

    def add(self, connection: Hashable, address: Hashable) -> list[Hashable]:
        """Counts `connection` as waiting; returns the ones to close to make room
        (no longer counted), never `connection` itself."""
        self.remove(connection)
        evicted: list[Hashable] = []
        if self.count(address) >= self.max_per_address:
            evicted.append(self._oldest(address))
        elif len(self) >= self.max_total:
            evicted.append(self._oldest(max(self._by_address, key=self.count)))
        self._by_address.setdefault(address, {})[connection] = None
        self._address_of[connection] = address
        return evicted

    def remove(self, connection: Hashable) -> None:
        address = self._address_of.pop(connection, None)
        if address is None:
            return
        waiting = self._by_address[address]
        del waiting[connection]
        if not waiting:
            del self._by_address[address]

    def _oldest(self, address: Hashable) -> Hashable:
        oldest = next(iter(self._by_address[address]))
        self.remove(oldest)
        return oldest


class HeaderDeadlineProtocol(H11Protocol):
    """H11Protocol that closes a connection whose next request's headers are
    late, and counts it in `pending` while they are awaited; a subclass per
    server sets header_timeout_s and pending."""

    header_timeout_s = 10.0
    pending = PendingConnections(1024, 128)
    _header_timer: asyncio.TimerHandle | None = None
    _awaited_after: object = None  # the cycle before the request being waited for

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_headers(after=None)

    def handle_events(self) -> None:
        super().handle_events()
        if self._header_timer is not None and self.cycle is not self._awaited_after:
            self._stop_timer()  # a request's headers arrived: its cycle began
            self.pending.remove(self)

    def on_response_complete(self) -> None:
        # Armed first: a pipelined request that super() starts disarms it.
        self._await_headers(after=self.cycle)
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_timer()
        self.pending.remove(self)
        super().connection_lost(exc)

    def _await_headers(self, after: object) -> None:
        self._stop_timer()
        self._awaited_after = after
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)
        address = self.client[0] if self.client else None
        for evicted in self.pending.add(self, address):
            evicted._close_waiting()  # type: ignore[attr-defined]

    def _stop_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        self._close_waiting()

    def _close_waiting(self) -> None:
        self._stop_timer()
        self.pending.remove(self)
        if not self.transport.is_closing():
            self.transport.close()


def uvicorn_limits(settings: GatewaySettings) -> dict[str, Any]:
    """uvicorn.Config's arguments for the limits in the settings. uvicorn's
    limit_concurrency stays off: it counts waiting connections too (the app's
    InFlightLimitMiddleware limits requests in flight instead)."""
    pending = PendingConnections(settings.max_pending_connections,
                                 settings.max_pending_per_address)
    protocol = type("GatewayHttpProtocol", (HeaderDeadlineProtocol,),
                    {"header_timeout_s": settings.header_timeout_s, "pending": pending})
    return {"http": protocol, "limit_concurrency": None,
            "timeout_keep_alive": settings.keep_alive_s,
            "h11_max_incomplete_event_size": settings.max_header_bytes}
