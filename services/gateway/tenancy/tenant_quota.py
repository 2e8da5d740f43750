"""Per-tenant admission at the gateway: generations in flight, generations
queued (accepted, no first token yet) and the rate of new ones (a token
bucket). Past any of them only that tenant gets QuotaExceeded (429 with
Retry-After); the others go on.

This is one gateway's early refusal, before a scheduler round trip. The
limits that hold across gateway replicas are the scheduler's
(services/scheduler/core/fairness/quotas.py), which gets each request's limits with it
and also holds tokens_per_minute and max_request_s.

Each admitted generation holds a Ticket: started() when its first token
arrives, release() when it ends whichever way. Pure: no web or gRPC imports,
the clock injected.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from services.gateway.requests.backend import Overloaded
from services.gateway.tenancy.tenants import Tenant, TenantLimits
from services.gateway.tenancy.token_bucket import TokenBucket

BUSY_RETRY_AFTER_S = 1  # in flight or queued: no way to know when one ends


class QuotaExceeded(Overloaded):
    """A tenant went past one of its limits (HTTP 429, gRPC RESOURCE_EXHAUSTED)."""

    def __init__(self, message: str, retry_after_s: int, reason: str) -> None:
        super().__init__(message, retry_after_s, code="tenant_quota_exceeded")
        self.reason = reason  # "in_flight" | "queued" | "rate"


@dataclass
class _Usage:
    in_flight: int = 0
    queued: int = 0
    refused: int = 0


class Ticket:
    """One admitted generation's hold on its tenant's counters."""

    def __init__(self, usage: _Usage) -> None:
        self._usage = usage
        self._queued = True
        self._held = True

    def started(self) -> None:
        """The first token arrived: no longer queued (later calls do nothing)."""
        if self._held and self._queued:
            self._queued = False
            self._usage.queued -= 1

    def release(self) -> None:
        """The generation ended (done, refused downstream, cancelled); idempotent."""
        if not self._held:
            return
        self.started()
        self._held = False
        self._usage.in_flight -= 1


class TenantQuotas:
    def __init__(self, tenants: Iterable[Tenant],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._limits: dict[str, TenantLimits] = {}
        self._usage: dict[str, _Usage] = {}
        self._buckets: dict[str, TokenBucket] = {}
        for tenant in tenants:
            if not tenant.limits.limited:
                continue
            limits = tenant.limits
            self._limits[tenant.name] = limits
            self._usage[tenant.name] = _Usage()
            if limits.requests_per_s is not None:
                self._buckets[tenant.name] = TokenBucket(
                    limits.requests_per_s, limits.burst or max(1, math.ceil(limits.requests_per_s)),
                    clock)

    def admit(self, name: str) -> Ticket | None:
        """A ticket for one more generation of tenant `name`; None when the
        name has no limits (no keys, or an unlimited tenant). Raises
        QuotaExceeded, spending nothing, when the tenant is at a limit."""
        limits = self._limits.get(name)
        if limits is None:
            return None
        usage = self._usage[name]
        if limits.max_in_flight is not None and usage.in_flight >= limits.max_in_flight:
            self._refuse(usage, name, "in_flight", BUSY_RETRY_AFTER_S,
                         f"{limits.max_in_flight} generations in flight")
        if limits.max_queued is not None and usage.queued >= limits.max_queued:
            self._refuse(usage, name, "queued", BUSY_RETRY_AFTER_S,
                         f"{limits.max_queued} generations waiting for their first token")
        bucket = self._buckets.get(name)
        if bucket is not None:
            wait_s = bucket.take()
            if wait_s > 0:
                self._refuse(usage, name, "rate", max(1, math.ceil(wait_s)),
                             f"its rate of {limits.requests_per_s:g} generations/s "
                             f"(burst {bucket.burst})")
        usage.in_flight += 1
        usage.queued += 1
        return Ticket(usage)

    def take_rate(self, name: str) -> None:
        """Spends one of tenant `name`'s request rate on a call that is no
        generation (/tokenize, /detokenize); QuotaExceeded when none is left."""
        bucket = self._buckets.get(name)
        wait_s = bucket.take() if bucket is not None else 0.0
        if wait_s > 0:
            self._refuse(self._usage[name], name, "rate", max(1, math.ceil(wait_s)),
                         f"its rate of {self._limits[name].requests_per_s:g} requests/s "
                         f"(burst {bucket.burst})")  # type: ignore[union-attr]

    @staticmethod
    def _refuse(usage: _Usage, name: str, reason: str, retry_after_s: int, limit: str) -> None:
        usage.refused += 1
        raise QuotaExceeded(f"Tenant {name!r} is at its limit of {limit}; retry later.",
                            retry_after_s, reason)

    def usage(self, name: str) -> tuple[int, int, int]:
        """(in flight, queued, refused so far) of a limited tenant; zeros otherwise."""
        usage = self._usage.get(name, _Usage())
        return usage.in_flight, usage.queued, usage.refused
