"""The gateway's drain on SIGTERM. From its start `/ready` answers 503 and new
generation requests get 503 with Retry-After (`/health` stays 200), while the
generations in flight run to their end; main.py stops the gateway once none
is left or DRAIN_TIMEOUT_S has passed. This module owns the state (draining,
generations in flight) and the middleware that refuses and counts them over
HTTP; the gRPC text API does the same through Drain.generation()."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

from starlette.types import ASGIApp, Receive, Scope, Send

from services.gateway.errors import ApiError, unavailable
from services.gateway.middleware import send_error

GENERATION_PATHS = frozenset({"/generate", "/v1/completions", "/v1/chat/completions", "/v1/responses"})
RETRY_AFTER_S = 2


class Drain:
    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def begin(self) -> None:
        self.draining = True

    @staticmethod
    def refusal() -> ApiError:
        return unavailable("The gateway is shutting down; retry the request.", RETRY_AFTER_S)

    @contextlib.contextmanager
    def generation(self) -> Iterator[None]:
        """One generation in flight while the block runs; refused (the 503 of
        refusal(), raised) while draining. For doors that raise ApiError."""
        if self.draining:
            raise self.refusal()
        with self.track():
            yield

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        """Counts one generation in flight while the block runs."""
        self.in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    async def wait_idle(self, timeout_s: float, interrupted: asyncio.Event | None = None) -> bool:
        """Waits until no generation is in flight (True), for at most `timeout_s`
        or until `interrupted` is set (False)."""
        waits = {asyncio.ensure_future(self._idle.wait())}
        if interrupted is not None:
            waits.add(asyncio.ensure_future(interrupted.wait()))
        try:
            await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        return self.in_flight == 0


class DrainMiddleware:
    """Refuses generation requests while draining; counts the others in flight
    until their response (a stream: its last byte) has gone."""

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") not in GENERATION_PATHS:
            await self.app(scope, receive, send)
            return
        if self.drain.draining:
            await send_error(send, self.drain.refusal())
            return
        with self.drain.track():
            await self.app(scope, receive, send)
