"""/ready's reason while no worker serves says what waits for one (WORKER_RECOVERY_S)."""

from __future__ import annotations

from services.gateway.requests.backend import SchedulerView
from services.gateway.convert import scheduler_view_from_proto

from fairserve.v1 import scheduler_pb2


def test_the_reason_names_the_requests_waiting_and_the_setting() -> None:
    view = scheduler_view_from_proto(scheduler_pb2.SchedulerStats(
        waiting_for_worker=12, worker_wait_s=7.4, worker_recovery_s=60.0))
    assert view.healthy_workers == 0
    assert view.not_ready_reason() == (
        "no healthy worker is registered with the scheduler; 12 request(s) wait for one to register, "
        "the longest for 7 s (WORKER_RECOVERY_S=60)")
    assert view.details["waiting_for_worker"] == 12


def test_with_nothing_waiting_the_reason_is_as_before() -> None:
    assert SchedulerView(workers=()).not_ready_reason() == "no healthy worker is registered with the scheduler"
