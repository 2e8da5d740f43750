"""Cache-aware routing under load, in the scheduler's core: a flood of requests that share a
prefix one worker holds (a tenant's system prompt) spreads over the other workers once that
worker is overloaded, so that neither the flooding tenant nor anyone routed to the same
worker queues behind it while other workers idle; below the slack, affinity holds."""

from __future__ import annotations

from collections import Counter

from services.scheduler.core.types import CoreConfig

from tests.unit.scheduler.fake_worker import FakeEngine
from tests.unit.scheduler.harness import Harness

SYSTEM = tuple(range(100, 196))        # 96 tokens every prompt of the tenant starts with


def workers_of(h: Harness, results) -> Counter:
    return Counter(h.core.worker_of(result.request_id) for result in results)


def test_a_flood_over_one_cached_prefix_spreads_once_its_worker_is_overloaded() -> None:
    h = Harness(CoreConfig(max_batch_size=8), {"w0": FakeEngine(), "w1": FakeEngine(), "w2": FakeEngine()})
    hints = {"w0": 96}                  # the index: w0 holds the system prompt
    flood = [h.submit(SYSTEM + (index,), max_tokens=4, client_id="flooder", hints=hints) for index in range(24)]
    placed = [h.core.worker_of(result.request_id) for result in flood]
    # Half of max_batch_size (4) ahead of the least loaded is the slack: w0 takes five, then the
    # others take turns (each one holds the prompt's blocks once it has computed them).
    assert placed[:5] == ["w0"] * 5 and Counter(placed) == Counter({"w0": 8, "w1": 8, "w2": 8})
    # Another tenant's request that w0's cache would serve waits behind 8 requests, not 24.
    other = h.submit(SYSTEM + (999,), max_tokens=4, client_id="victim", hints=hints)
    assert Counter(placed)[h.core.worker_of(other.request_id)] == 8
    # Counted by reason (fairserve_scheduler_routed_total): the first request w1 and w2 took went
    # there because w0 was overloaded; every other one to a worker holding, or about to hold,
    # the prompt.
    assert h.core.stats().routed == {"cache": 23, "load": 2}

def test_affinity_holds_within_the_slack() -> None:
    h = Harness(CoreConfig(max_batch_size=8, routing_load_slack=100),
                {"w0": FakeEngine(), "w1": FakeEngine()})
    requests = [h.submit(SYSTEM + (index,), max_tokens=4, hints={"w0": 96}) for index in range(24)]
    assert workers_of(h, requests) == Counter({"w0": 24})


def test_requests_without_a_cached_prefix_still_go_to_the_least_loaded() -> None:
    h = Harness(CoreConfig(max_batch_size=8), {"w0": FakeEngine(), "w1": FakeEngine()})
    requests = [h.submit((index, index + 1, index + 2), max_tokens=4) for index in range(10)]
    assert workers_of(h, requests) == Counter({"w0": 5, "w1": 5})
