"""One LatencyTracker per tenant, beside the server-wide one, so a tenant's
/stats shows its own latencies, rates, totals and sessions and nobody else's.

Only the named tenants (the keys' tenants) get one, made at start so that
their uptimes and rates match the gateway's; memory is bounded by the keys
configured, and each keeps fewer samples and sessions than the server-wide
tracker. Pure: no web or gRPC imports, and the clock is injected.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from services.gateway.observability.latency_tracker import Clock, LatencyTracker, RequestRecord

TENANT_MAX_SAMPLES = 1000
TENANT_MAX_SESSIONS = 256


class TenantTrackers:
    def __init__(self, tenant_names: Iterable[str] = (), clock: Clock = time.monotonic,
                 window_s: float = 60.0) -> None:
        self._clock = clock
        self._window_s = window_s
        self._trackers = {name: self._new() for name in tenant_names}

    def record(self, tenant: str, request: RequestRecord) -> None:
        """Counts a finished request of `tenant`; a name that is not a
        tenant's (no API keys: a session or user) is not tracked here."""
        tracker = self._trackers.get(tenant)
        if tracker is not None:
            tracker.record(request)

    def snapshot(self, tenant: str) -> dict:
        """The tenant's LatencyTracker.snapshot(); an unknown name gets an empty one."""
        tracker = self._trackers.get(tenant)
        return (tracker if tracker is not None else self._new()).snapshot()

    def _new(self) -> LatencyTracker:
        return LatencyTracker(window_s=self._window_s, clock=self._clock,
                              max_samples=TENANT_MAX_SAMPLES, max_sessions=TENANT_MAX_SESSIONS)
