"""The token bucket and the per-tenant counters, on a hand-driven clock."""

from __future__ import annotations

import math

import pytest

from services.gateway.tenancy.tenant_quota import QuotaExceeded, TenantQuotas
from services.gateway.tenancy.tenants import Tenant, TenantLimits
from services.gateway.tenancy.token_bucket import TokenBucket


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_bucket_spends_its_burst_then_refills_at_its_rate() -> None:
    clock = Clock()
    bucket = TokenBucket(rate_per_s=2.0, burst=3, clock=clock)
    assert [bucket.take() for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.take() == pytest.approx(0.5)  # one token comes every 0.5 s
    clock.now += 0.25
    assert bucket.take() == pytest.approx(0.25)
    clock.now += 0.25
    assert bucket.take() == 0.0
    clock.now += 60
    assert bucket.tokens == 3.0  # never more than the burst
    assert bucket.take(4) == math.inf and bucket.tokens == 3.0
    clock.now -= 30  # a clock stepping back adds nothing
    assert bucket.tokens == 3.0
    with pytest.raises(ValueError):
        TokenBucket(0, 1, clock)


def quotas(clock: Clock, **limits: float) -> TenantQuotas:
    free = Tenant("free", TenantLimits(max_in_flight=None))  # keyed tenants have one by default
    return TenantQuotas([Tenant("a", TenantLimits(**limits)), free], clock)  # type: ignore[arg-type]


def refused(quota: TenantQuotas, name: str = "a") -> QuotaExceeded:
    with pytest.raises(QuotaExceeded) as raised:
        quota.admit(name)
    return raised.value


def test_unlimited_names_get_no_ticket() -> None:
    quota = quotas(Clock(), max_in_flight=1)
    assert quota.admit("free") is None and quota.admit("unknown") is None
    assert quota.usage("free") == (0, 0, 0)


def test_in_flight_limit_and_release() -> None:
    quota = quotas(Clock(), max_in_flight=2)
    first, second = quota.admit("a"), quota.admit("a")
    assert first is not None and second is not None
    error = refused(quota)
    assert (error.reason, error.retry_after_s, error.code) == ("in_flight", 1, "tenant_quota_exceeded")
    assert "'a'" in error.message and "2 generations in flight" in error.message
    first.release()
    first.release()  # idempotent
    assert quota.usage("a") == (1, 1, 1)
    assert quota.admit("a") is not None


def test_queued_counts_until_the_first_token() -> None:
    quota = quotas(Clock(), max_queued=1)
    ticket = quota.admit("a")
    assert ticket is not None
    assert refused(quota).reason == "queued"
    ticket.started()
    ticket.started()
    assert quota.usage("a") == (1, 0, 1)
    other = quota.admit("a")
    assert other is not None and quota.usage("a") == (2, 1, 1)
    other.release()  # released while still queued
    ticket.release()
    assert quota.usage("a") == (0, 0, 1)


def test_rate_limit_with_burst_and_retry_after() -> None:
    clock = Clock()
    quota = quotas(clock, requests_per_s=0.5, burst=2)
    assert quota.admit("a") is not None and quota.admit("a") is not None
    error = refused(quota)
    assert error.reason == "rate" and error.retry_after_s == 2  # 1 token / 0.5 per s
    clock.now += 2
    assert quota.admit("a") is not None


def test_a_refusal_spends_nothing() -> None:
    clock = Clock()
    quota = quotas(clock, max_in_flight=1, requests_per_s=1, burst=2)
    ticket = quota.admit("a")
    assert ticket is not None
    for _ in range(5):
        assert refused(quota).reason == "in_flight"
    ticket.release()
    assert quota.admit("a") is not None  # the bucket's second token is still there
