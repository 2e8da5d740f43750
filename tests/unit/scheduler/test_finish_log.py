"""The scheduler's "request finished" log line, for every way a request ends:
an error's message rides under its own key (LogRecord reserves "message")."""

from __future__ import annotations

import logging

import pytest

from common.types import Usage
from services.scheduler.core.types import Finish, FinishReason, RequestUpdate
from services.scheduler.server import SchedulerService


@pytest.mark.parametrize("message", ["", "worker worker-0 stopped heartbeating"])
def test_every_finish_is_logged(caplog: pytest.LogCaptureFixture, message: str) -> None:
    reason = FinishReason.ERROR if message else FinishReason.STOP
    update = RequestUpdate("r1", finish=Finish(reason, Usage(3, 1), message, queue_wait_s=0.5))
    with caplog.at_level(logging.INFO, logger="services.scheduler.server"):
        SchedulerService._log_finish("r1.0", update)
    [record] = [r for r in caplog.records if r.getMessage() == "request finished"]
    assert record.finish_reason == reason.value and record.queue_wait_ms == 500.0
    assert getattr(record, "finish_message", "") == message
