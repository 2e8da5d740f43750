"""What the scheduler tells the rest of the system for observability: each
request's queue wait in its finish event, sequence ids that name their
request, the worker's evictions and used blocks in its stats, and the
per-worker batch size in its metrics."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from common.sequence_ids import request_id_of, sequence_id
from services.scheduler import convert
from services.scheduler.core.types import CoreConfig, RequestUpdate
from common.step import PoolStats, StepOutput
from services.scheduler.metrics import SchedulerMetrics
from tests.unit.scheduler.fake_worker import FakeEngine
from tests.unit.scheduler.harness import Harness


def test_a_sequence_id_names_its_request() -> None:
    seq_id = sequence_id("client-id.0.ab12", "f00d")
    assert seq_id == "client-id.0.ab12/f00d"
    assert request_id_of(seq_id) == "client-id.0.ab12"
    assert request_id_of(sequence_id("with/slash", "1")) == "with/slash"
    assert request_id_of("plain") == "plain"
    with pytest.raises(ValueError):
        sequence_id("r", "a/b")


def test_the_scheduler_gives_each_sequence_an_id_with_its_request_id() -> None:
    h = Harness(CoreConfig(max_batch_size=1), FakeEngine())
    h.submit((1, 2, 3), max_tokens=2, request_id="first")
    h.submit((4, 5, 6), max_tokens=2, request_id="second")
    h.run()
    registered = [new.seq_id for plan in h.plans["w0"] for new in plan.new_sequences]
    assert [request_id_of(seq_id) for seq_id in registered] == ["first", "second"]
    assert len(set(registered)) == 2


def test_the_finish_carries_the_queue_wait_from_arrival_to_first_admission() -> None:
    h = Harness(CoreConfig(max_batch_size=1), FakeEngine(), step_s=0.5)
    h.submit((1, 2, 3), max_tokens=3, request_id="first")
    h.submit((4, 5, 6), max_tokens=3, request_id="waits")
    h.run()
    first, waits = h.streams["first"].finish, h.streams["waits"].finish
    assert first is not None and waits is not None
    assert first.queue_wait_s == pytest.approx(0.0)
    assert waits.queue_wait_s == pytest.approx(1.5)  # three steps of 0.5 s behind the first one
    assert convert.generate_event_to_proto(RequestUpdate("waits", finish=waits)).finish.queue_wait_ms == \
        pytest.approx(1500.0)


def test_a_request_cancelled_before_admission_has_no_queue_wait() -> None:
    h = Harness(CoreConfig(max_batch_size=1), FakeEngine())
    h.submit((1, 2, 3), max_tokens=3, request_id="queued")
    h.cancel("queued")
    finish = h.streams["queued"].finish
    assert finish is not None and finish.queue_wait_s is None
    assert convert.generate_event_to_proto(RequestUpdate("queued", finish=finish)).finish.queue_wait_ms == 0.0


def test_worker_stats_carry_the_pool_evictions_and_used_blocks() -> None:
    h = Harness(CoreConfig(), FakeEngine())
    h.submit((1, 2, 3), max_tokens=2)
    plan = h.core.plan_step("w0")
    assert plan is not None
    pool = PoolStats(total_blocks=64, free_blocks=50, cached_blocks=10, used_blocks=4, evictions=7)
    h.core.apply_step("w0", StepOutput(step_id=plan.step_id, results=(), pool=pool))
    summary = convert.stats_to_proto(h.core.stats()).workers[0]
    assert (summary.evictions, summary.used_blocks) == (7, 4)
    assert summary.last_batch_size == 1


def test_the_metrics_export_each_workers_batch_size_and_step_histogram_from_registration() -> None:
    h = Harness(CoreConfig(), FakeEngine())
    h.submit((1, 2, 3), max_tokens=2)
    h.step()
    metrics = SchedulerMetrics()
    metrics.add_worker("w0")
    text = generate_latest(metrics.registry).decode()
    assert 'fairserve_scheduler_worker_step_seconds_count{worker="w0"} 0.0' in text
    metrics.publish(h.core.stats())
    text = generate_latest(metrics.registry).decode()
    assert 'fairserve_scheduler_worker_batch_size{worker="w0"} 1.0' in text
