"""Graceful stop for the services' asyncio mains: SIGINT and SIGTERM run a callback
(usually setting the event the main waits on) instead of killing the process;
services that drain count them (StopRequests: the first drains, a second stops now)."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def on_stop_signal(callback: Callable[[], object]) -> None:
    """Runs `callback` on the running loop when a stop signal arrives."""
    loop = asyncio.get_running_loop()
    for signum in STOP_SIGNALS:
        loop.add_signal_handler(signum, callback)


class StopRequests:
    """Stop signals counted, for services that drain: the first one sets
    `graceful` (finish what is in flight, then stop), any later one sets `now`
    (stop at once)."""

    def __init__(self) -> None:
        self.graceful = asyncio.Event()
        self.now = asyncio.Event()

    def __call__(self) -> None:
        (self.now if self.graceful.is_set() else self.graceful).set()


def stop_requests() -> StopRequests:
    """A StopRequests fed by SIGINT and SIGTERM on the running loop."""
    requests = StopRequests()
    on_stop_signal(requests)
    return requests
