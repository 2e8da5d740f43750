"""Per-tenant quotas in the scheduler (core/quotas.py and budget.py), on a
hand-driven clock: in flight, queued, request rate, the token budget (prompt
at admission, output as produced, debt paid by the refill), max_request_s,
and resubmitted work that is neither refused nor charged again."""

from __future__ import annotations

import math

import pytest

from services.scheduler.core.budget import Budget
from services.scheduler.core.fairness.quotas import TenantQuotas, TenantUsage
from services.scheduler.core.types import TenantQuota

from tests.unit.scheduler.harness import FakeClock


def test_budget_takes_what_it_holds_charges_into_debt_and_refills() -> None:
    clock = FakeClock()
    budget = Budget(rate_per_s=10.0, capacity=100, clock=clock)
    assert budget.take(60) == 0.0 and budget.level == 40
    assert budget.take(50) == pytest.approx(1.0)   # 10 short at 10 a second; nothing spent
    assert budget.level == 40
    budget.charge(70)                              # output tokens: into debt
    assert budget.level == -30
    assert budget.wait_s(10) == pytest.approx(4.0)  # the debt first, then the 10
    assert budget.wait_s(101) == math.inf
    clock.advance(100)
    assert budget.full and budget.level == 100
    clock.advance(-50)                             # a clock stepping back adds nothing
    assert budget.level == 100
    budget.reshape(5.0, 20)
    assert budget.level == 20 and budget.capacity == 20
    with pytest.raises(ValueError):
        Budget(0, 10, clock)


def _quotas() -> tuple[FakeClock, TenantQuotas]:
    clock = FakeClock()
    return clock, TenantQuotas(clock)


def test_in_flight_and_queued_limits_count_every_request_of_the_tenant() -> None:
    _, quotas = _quotas()
    quota = TenantQuota(max_in_flight=2)
    assert quotas.admit("r1", "a", quota, 5) is None
    assert quotas.admit("r2", "a", quota, 5) is None
    refusal = quotas.admit("r3", "a", quota, 5)
    assert refusal is not None and refusal.reason == "in_flight" and refusal.retry_after_s == 1
    assert "2 generations in flight" in refusal.message
    assert quotas.admit("b1", "b", quota, 5) is None      # another tenant is not touched
    assert quotas.usage("a") == TenantUsage(in_flight=2, queued=2, refused=1)
    quotas.release("r1")
    quotas.release("r1")                                  # idempotent
    assert quotas.admit("r3", "a", quota, 5) is None

    queued = TenantQuota(max_queued=1)
    assert quotas.admit("q1", "c", queued, 5) is None
    assert quotas.admit("q2", "c", queued, 5).reason == "queued"  # type: ignore[union-attr]
    quotas.produced("q1", 1)                              # its first token: no longer queued
    assert quotas.admit("q2", "c", queued, 5) is None
    assert quotas.usage("c") == TenantUsage(in_flight=2, queued=1, refused=1)


def test_no_quota_counts_nothing() -> None:
    _, quotas = _quotas()
    assert quotas.admit("r1", "a", None, 5) is None
    quotas.produced("r1", 3)
    quotas.release("r1")
    assert quotas.usage("a") == TenantUsage()


def test_request_rate_is_a_bucket_with_its_burst() -> None:
    clock, quotas = _quotas()
    quota = TenantQuota(requests_per_s=0.5, burst=2)
    for index in range(2):
        assert quotas.admit(f"r{index}", "a", quota, 1) is None
    refusal = quotas.admit("r2", "a", quota, 1)
    assert refusal is not None and refusal.reason == "rate" and refusal.retry_after_s == 2
    clock.advance(2)
    assert quotas.admit("r2", "a", quota, 1) is None


def test_token_budget_charges_the_prompt_then_the_output_and_says_when_it_refills() -> None:
    clock, quotas = _quotas()
    quota = TenantQuota(tokens_per_minute=600)            # 10 tokens a second
    assert quotas.admit("r1", "a", quota, 400) is None
    quotas.produced("r1", 300)                            # 600 - 400 - 300: 100 in debt
    refusal = quotas.admit("r2", "a", quota, 50)
    assert refusal is not None and refusal.reason == "tokens"
    assert refusal.retry_after_s == 15                    # (100 + 50) / 10 a second
    assert "600 tokens a minute" in refusal.message
    clock.advance(15)
    assert quotas.admit("r2", "a", quota, 50) is None
    # A prompt larger than the whole budget can never pass: retry_after_s 0.
    never = quotas.admit("r3", "a", quota, 601)
    assert never is not None and never.reason == "too_large" and never.retry_after_s == 0


def test_a_resubmission_is_never_refused_nor_charged_again_but_counts_in_flight() -> None:
    clock, quotas = _quotas()
    quota = TenantQuota(max_in_flight=1, requests_per_s=1, burst=1, tokens_per_minute=60)
    assert quotas.admit("r1", "a", quota, 60) is None       # spends the whole budget and the burst
    # The gateway lost its scheduler and sends r1 again (it streamed tokens already).
    quotas.release("r1")
    assert quotas.admit("r1.r1", "a", quota, 60, resubmitted=True, started=True) is None
    assert quotas.usage("a") == TenantUsage(in_flight=1, queued=0, refused=0)
    # Nothing was charged: one second refills the one request the burst holds and 1 token.
    clock.advance(1)
    quotas.release("r1.r1")
    refusal = quotas.admit("r2", "a", quota, 2)
    assert refusal is not None and refusal.reason == "tokens"  # 1 token there, not 2: r1's charge stands
    assert quotas.admit("r3", "a", quota, 1) is None


def test_max_request_s_marks_requests_past_their_deadline() -> None:
    clock, quotas = _quotas()
    assert quotas.admit("slow", "a", TenantQuota(max_request_s=30), 5) is None
    assert quotas.admit("free", "a", TenantQuota(), 5) is None
    clock.advance(29.9)
    assert quotas.overdue() == []
    clock.advance(0.1)
    assert quotas.overdue() == [("slow", 30.0)]
    quotas.release("slow")
    assert quotas.overdue() == []


def test_the_latest_figures_are_the_tenants_and_idle_tenants_are_forgotten() -> None:
    _, quotas = _quotas()
    assert quotas.admit("r1", "a", TenantQuota(max_in_flight=1), 5) is None
    assert quotas.admit("r2", "a", TenantQuota(max_in_flight=2), 5) is None  # raised by a newer request
    assert quotas.admit("r3", "a", TenantQuota(max_in_flight=2), 5) is not None
    quotas.release("r1")
    quotas.release("r2")
    assert quotas.usage("a") == TenantUsage()              # nothing held, nothing saved: forgotten
    assert not quotas._tenants                              # test-only peek: no state kept
