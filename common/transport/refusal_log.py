"""Warnings for refused internal calls, rate-limited per calling host: the first
refusal from a host is logged with the caller's address; the next ones from it
within the interval are only counted, and its next warning says how many were
left out (`suppressed`). A flood of bad calls thus writes a line per host per
interval, not one per call. The presented token is never logged."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from common.transport.peer import MAX_PEER_CHARS, peer_host

DEFAULT_INTERVAL_S = 10.0
MAX_HOSTS = 1024           # hosts remembered; beyond, one shared entry counts the rest
OTHER_HOSTS = "*"


@dataclass
class _Host:
    logged_at: float
    suppressed: int = 0


class RefusalLog:
    def __init__(self, logger: logging.Logger, message: str, interval_s: float = DEFAULT_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic, max_hosts: int = MAX_HOSTS) -> None:
        self._log = logger
        self._message = message
        self._interval_s = interval_s
        self._clock = clock
        self._max_hosts = max_hosts
        self._hosts: dict[str, _Host] = {}

    def refused(self, peer: str, method: str, reason: str) -> bool:
        """Notes one refused call; True when it was logged, False when counted."""
        now = self._clock()
        host = self._bucket(peer_host(peer), now)
        entry = self._hosts.get(host)
        if entry is not None and now - entry.logged_at < self._interval_s:
            entry.suppressed += 1
            return False
        suppressed = entry.suppressed if entry is not None else 0
        self._hosts[host] = _Host(logged_at=now)
        self._log.warning(self._message, extra={"peer": (peer or "unknown")[:MAX_PEER_CHARS],
                                                "method": method[:MAX_PEER_CHARS], "reason": reason,
                                                "suppressed": suppressed})
        return True

    def _bucket(self, host: str, now: float) -> str:
        """The host's own entry, or the shared one while too many hosts are remembered
        (hosts quiet for an interval are forgotten first, with their counts)."""
        if host in self._hosts or len(self._hosts) < self._max_hosts:
            return host
        self._hosts = {name: entry for name, entry in self._hosts.items()
                       if now - entry.logged_at < self._interval_s}
        return host if len(self._hosts) < self._max_hosts else OTHER_HOSTS
