"""Graceful stop for the services' asyncio mains: SIGINT and SIGTERM run a callback
(usually setting the event the main waits on) instead of killing the process."""

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
