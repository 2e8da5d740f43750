"""The detached log alone: owners, expiry DETACHED_TTL_S after the end."""

from __future__ import annotations

from common.types import Usage
from services.scheduler.core.types import Finish, FinishReason, RequestUpdate
from services.scheduler.detached import DetachedLog


class _Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def test_an_ended_request_is_kept_ttl_s_for_its_client_only() -> None:
    clock = _Clock()
    log = DetachedLog(ttl_s=5.0, clock=clock)
    log.open("r1", object(), "alice", authenticated=True)
    log.open("r2", object(), "anonymous", authenticated=False)
    assert log.get("r1", "bob") is None and log.get("r1", "alice") is not None
    assert log.get("r2", "anyone") is not None            # no API keys: nothing to tell apart
    log.note(RequestUpdate("r1", finish=Finish(FinishReason.LENGTH, Usage(1, 1, 0))))
    clock.now = 4.9
    assert log.get("r1", "alice") is not None
    clock.now = 5.0
    assert log.get("r1", "alice") is None and log.get("r2", "anyone") is not None   # r2 has not ended
