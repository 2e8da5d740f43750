"""The core's running totals and the stats snapshot built from them."""

from __future__ import annotations

from services.scheduler.core.fairness.counters import CoreCounters, core_stats
from services.scheduler.core.state import Phase
from services.scheduler.core.types import FinishReason, Gate, Policy

from tests.unit.scheduler.plain_state import make_request, make_worker


def test_a_hold_counts_once_per_request_and_gate() -> None:
    counts = CoreCounters()
    first, second = make_request(1), make_request(2)
    for _ in range(3):
        counts.count_hold(first, Gate.ACTIVE_KV)
    counts.count_hold(first, Gate.CACHE_POOL)
    counts.count_hold(second, Gate.ACTIVE_KV)
    assert counts.holds == {"active_kv": 2, "cache_pool": 1}
    assert first.held_by == {Gate.ACTIVE_KV, Gate.CACHE_POOL}


def test_queue_waits_drain_and_admissions_keep_counting() -> None:
    counts = CoreCounters()
    counts.count_admission(0.5)
    counts.count_admission(1.5)
    assert counts.drain_queue_waits() == [0.5, 1.5]
    assert counts.drain_queue_waits() == []
    assert counts.admitted == 2


def test_core_stats_sum_the_workers_and_judge_health_by_the_heartbeat() -> None:
    counts = CoreCounters()
    counts.count_finish(FinishReason.LENGTH)
    counts.count_finish(FinishReason.LENGTH)
    counts.count_finish(FinishReason.STOP)
    counts.count_rejection(Gate.QUEUE)
    fresh, silent = make_worker("w0", reserved_kv_tokens=10), make_worker("w1", reserved_kv_tokens=5)
    fresh.last_heartbeat_s, silent.last_heartbeat_s = 95.0, 80.0
    fresh.pending.append(make_request(1))
    silent.active.append(make_request(2, phase=Phase.ACTIVE))
    stats = core_stats(Policy.VTC, counts, [fresh, silent], (), now=100.0, heartbeat_timeout_s=10.0)
    assert (stats.pending, stats.prefilling, stats.active, stats.reserved_kv_tokens) == (1, 0, 1, 15)
    assert (stats.finished, stats.finished_by_reason, stats.rejections) == (3, {"length": 2, "stop": 1}, {"queue": 1})
    assert [(w.worker_id, w.healthy, w.pending, w.running) for w in stats.workers] == \
        [("w0", True, 1, 0), ("w1", False, 0, 1)]
