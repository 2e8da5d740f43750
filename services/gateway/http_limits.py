"""What one slow or greedy HTTP client can hold: uvicorn's connection limit
(past it, 503), its keep-alive timeout and h11's header size limit, plus a
deadline uvicorn lacks: the request line and headers must arrive within
header_timeout_s of the connection opening or the previous response ending,
else the connection is closed. (The body's deadline is BodyLimitMiddleware's.)

The server speaks h11, whose limits are configurable, rather than httptools.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from services.gateway.settings import GatewaySettings


class HeaderDeadlineProtocol(H11Protocol):
    """H11Protocol that closes a connection whose next request's headers are
    late; a subclass per server sets header_timeout_s."""

    header_timeout_s = 10.0
    _header_timer: asyncio.TimerHandle | None = None
    _awaited_after: object = None  # the cycle before the request being waited for

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_headers(after=None)

    def handle_events(self) -> None:
        super().handle_events()
        if self._header_timer is not None and self.cycle is not self._awaited_after:
            self._stop_timer()  # a request's headers arrived: its cycle began

    def on_response_complete(self) -> None:
        # Armed first: a pipelined request that super() starts disarms it.
        self._await_headers(after=self.cycle)
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_timer()
        super().connection_lost(exc)

    def _await_headers(self, after: object) -> None:
        self._stop_timer()
        self._awaited_after = after
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _stop_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()


def uvicorn_limits(settings: GatewaySettings) -> dict[str, Any]:
    """uvicorn.Config's arguments for the limits in the settings."""
    protocol = type("GatewayHttpProtocol", (HeaderDeadlineProtocol,),
                    {"header_timeout_s": settings.header_timeout_s})
    return {"http": protocol, "limit_concurrency": settings.max_connections,
            "timeout_keep_alive": settings.keep_alive_s,
            "h11_max_incomplete_event_size": settings.max_header_bytes}
