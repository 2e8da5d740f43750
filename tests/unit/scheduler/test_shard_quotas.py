"""Tenant quotas across scheduler shards (core/fairness/peer_quotas.py): a tenant that
spreads its requests over two shards gets its limits once, not twice. The attack first,
as a hostile tenant would run it (every test without the exchange shows the limit
doubled), then the peer bookkeeping (snapshots, growth, a peer gone), then two real
schedulers naming each other in SCHEDULER_PEERS."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import grpc
import pytest
from fairserve.v1 import scheduler_pb2

from common.transport.grpc_server import REJECTION_KEY
from services.scheduler import convert
from services.scheduler.core.fairness.peer_quotas import PeerHolds
from services.scheduler.core.fairness.quotas import TenantQuotas
from services.scheduler.core.types import QuotaUsage, TenantQuota

from tests.unit.scheduler.harness import FakeClock
from tests.unit.scheduler.test_transport import _request, make_stack  # noqa: F401 (the fixture)


def _shards() -> tuple[FakeClock, TenantQuotas, TenantQuotas]:
    """Two shards that have read each other once (a baseline), as running shards have."""
    clock = FakeClock()
    first, second = TenantQuotas(clock), TenantQuotas(clock)
    _exchange(first, second)
    return clock, first, second


def _exchange(first: TenantQuotas, second: TenantQuotas) -> None:
    first.note_peer("second", second.report())
    second.note_peer("first", first.report())


@pytest.mark.parametrize("exchange", [False, True])
def test_requests_spread_over_two_shards_get_the_in_flight_limit_once(exchange: bool) -> None:
    _, first, second = _shards()
    quota = TenantQuota(max_in_flight=2)
    admitted = 0
    for number in range(6):                        # the hostile tenant alternates shards
        shard = (first, second)[number % 2]
        admitted += shard.admit(f"r{number}", "mallory", quota, 5) is None
        if exchange:
            _exchange(first, second)
    assert admitted == (2 if exchange else 4)
    if exchange:
        refusal = second.admit("r9", "mallory", quota, 5)
        assert refusal is not None and refusal.reason == "in_flight"
        first.release("r0")                       # one ends on the first shard...
        _exchange(first, second)
        assert second.admit("r10", "mallory", quota, 5) is None   # ...and the second may take one
        assert first.admit("r11", "honest", quota, 5) is None     # another tenant was never held


@pytest.mark.parametrize("exchange", [False, True])
def test_a_token_budget_spent_on_one_shard_is_spent_on_the_other(exchange: bool) -> None:
    clock, first, second = _shards()
    quota = TenantQuota(tokens_per_minute=600)     # 10 tokens a second
    assert first.admit("a", "mallory", quota, 400) is None
    first.produced("a", 150)                       # 550 of 600 spent on the first shard
    first.release("a")
    if exchange:
        _exchange(first, second)
    refusal = second.admit("b", "mallory", quota, 400)
    if not exchange:
        assert refusal is None                     # the budget twice over
        return
    assert refusal is not None and refusal.reason == "tokens"
    assert refusal.retry_after_s == 35             # 350 short at 10 a second
    clock.advance(35)
    assert second.admit("b", "mallory", quota, 400) is None
    _exchange(first, second)
    assert first.admit("c", "mallory", quota, 100) is not None     # the second shard's spend came back


def test_a_request_rate_holds_over_both_shards() -> None:
    _, first, second = _shards()
    quota = TenantQuota(requests_per_s=1.0, burst=2)
    assert first.admit("a", "mallory", quota, 1) is None
    assert first.admit("b", "mallory", quota, 1) is None
    _exchange(first, second)
    refusal = second.admit("c", "mallory", quota, 1)
    assert refusal is not None and refusal.reason == "rate"


def test_the_queued_limit_counts_the_other_shards_queue() -> None:
    _, first, second = _shards()
    quota = TenantQuota(max_queued=1)
    assert first.admit("a", "mallory", quota, 5) is None
    _exchange(first, second)
    assert second.admit("b", "mallory", quota, 5).reason == "queued"   # type: ignore[union-attr]
    first.produced("a", 1)                         # its first token: no longer queued
    _exchange(first, second)
    assert second.admit("b", "mallory", quota, 5) is None


def test_a_peer_that_stops_answering_holds_nothing_and_resubmissions_pass() -> None:
    _, first, second = _shards()
    quota = TenantQuota(max_in_flight=1)
    assert first.admit("a", "mallory", quota, 5) is None
    _exchange(first, second)
    assert second.admit("b", "mallory", quota, 5) is not None
    assert second.admit("a", "mallory", quota, 5, resubmitted=True) is None   # moved here: never refused
    second.release("a")
    second.forget_peer("first")                    # the first shard died: its requests move here
    assert second.admit("b", "mallory", quota, 5) is None


def test_peer_holds_are_snapshots_and_spending_is_growth() -> None:
    holds = PeerHolds()
    quota = TenantQuota(max_in_flight=4, tokens_per_minute=100)
    usage = QuotaUsage("a", quota, in_flight=2, queued=1, admitted=3, charged_tokens=50)
    assert holds.note("p", [usage]) == []                            # the first read: a baseline
    assert holds.held("a") == (2, 1) and holds.held("b") == (0, 0)
    spent = holds.note("p", [replace(usage, in_flight=1, queued=0, admitted=4, charged_tokens=80)])
    assert [(s.tenant, s.requests, s.tokens) for s in spent] == [("a", 1, 30)]
    holds.note("q", [replace(usage, in_flight=3)])
    assert holds.held("a") == (4, 1)                                 # summed over peers
    assert holds.note("p", []) == [] and holds.held("a") == (3, 1)   # forgotten there: holds nothing
    holds.forget("q")
    assert holds.held("a") == (0, 0)


def test_only_own_spending_is_reported_so_nothing_echoes_between_shards() -> None:
    _, first, second = _shards()
    quota = TenantQuota(tokens_per_minute=600)
    first.admit("a", "mallory", quota, 100)
    for _ in range(3):
        _exchange(first, second)
    (mine,) = first.report()
    (theirs,) = second.report()
    assert (mine.charged_tokens, theirs.charged_tokens) == (100, 0)
    assert second.admit("b", "mallory", quota, 500) is None        # 100 + 500 of 600
    assert second.admit("c", "mallory", quota, 50) is not None


def test_the_report_goes_over_the_wire_whole() -> None:
    _, first, _ = _shards()
    quota = TenantQuota(max_in_flight=3, max_queued=2, requests_per_s=4.0, burst=5, tokens_per_minute=900,
                        max_request_s=30.0)
    first.admit("a", "mallory", quota, 12)
    stats = scheduler_pb2.SchedulerStats(quotas=[
        scheduler_pb2.TenantQuotaUsage(tenant=u.tenant, quota=convert.tenant_quota_to_proto(u.quota),
                                       in_flight=u.in_flight, queued=u.queued, admitted=u.admitted,
                                       charged_tokens=u.charged_tokens) for u in first.report()])
    assert convert.quota_usages_from_proto(scheduler_pb2.SchedulerStats.FromString(
        stats.SerializeToString())) == first.report()


async def test_two_schedulers_naming_each_other_hold_a_tenant_to_one_limit(make_stack) -> None:
    """Two real shards exchanging every 20 ms: the tenant's generation in flight on the
    first shard makes the second refuse its next one, with the quota's status."""
    first = await make_stack()
    second = await make_stack(peers=(first.address,), peer_exchange_s=0.02)
    for stack in (first, second):
        worker = await stack.add_worker(f"w-{stack.server.port}")
        worker.servicer.running.clear()            # steps hang: what is admitted stays in flight
    quota = scheduler_pb2.TenantQuota(max_in_flight=1)
    fields = dict(client_id="mallory", authenticated=True, quota=quota)
    held = first.stub.Generate(_request("m1", **fields), timeout=10)
    refused = None
    for _ in range(100):                           # until the second shard has read the first
        await asyncio.sleep(0.05)
        call = second.stub.Generate(_request("m2", **fields), timeout=5)
        try:
            await asyncio.wait_for(anext(aiter(call)), 0.3)
        except grpc.aio.AioRpcError as error:
            refused = error
            break
        except asyncio.TimeoutError:
            call.cancel()                          # admitted before the exchange: let it go
    assert refused is not None and refused.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (REJECTION_KEY, "quota") in tuple(refused.trailing_metadata())
    assert "1 generations in flight" in refused.details()
    held.cancel()
