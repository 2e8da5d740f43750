"""A generation that outlives its scheduler.

ResumableGeneration streams one spec's events from the scheduler and keeps the
token ids it has received. When the scheduler is lost mid-request
(SchedulerLost: the connection failed, which is neither a finish nor a
refusal), it waits for the scheduler to come back, retrying with backoff for up
to SCHEDULER_RECOVERY_S, and resubmits the request under a fresh scheduler
request id as a continuation: the same prompt and budget, with the tokens
received so far as output already generated (GenerationSpec.resume_token_ids;
max_tokens and min_tokens count them). The scheduler resumes it as it resumes
a preempted request, so the events go on with the next token: no gap and no
repeat, and seeded sampling draws on where it was. A request lost before its
first token is simply sent again. A gateway that has not reached its scheduler
since it started has nothing to wait for: its requests fail at once (503).

While it recovers, the refusals a restarting scheduler gives (no worker has
registered yet, a full queue) are retried too. Past the deadline, or after the
request was cancelled, the last error is raised, as it was without recovery.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import replace

from services.gateway.requests.backend import (
    BackendError,
    GenerationEvent,
    GenerationSpec,
    Overloaded,
    SchedulerBackend,
    SchedulerLost,
    Unavailable,
)

log = logging.getLogger(__name__)
FIRST_RETRY_S = 0.05
MAX_RETRY_S = 1.0


class ResumableGeneration:
    def __init__(self, backend: SchedulerBackend, spec: GenerationSpec, request_id: str,
                 trace_id: str = "", recovery_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._backend = backend
        self._spec = spec
        self._first_id = request_id
        self._trace_id = trace_id
        self._recovery_s = recovery_s
        self._clock = clock
        self._cancelled = False
        self.request_id = request_id     # the scheduler's id of the current submission
        self.received: list[int] = []    # token ids received, over every submission
        self.submissions = 1

    async def events(self) -> AsyncIterator[GenerationEvent]:
        """The request's events, over as many submissions as it takes."""
        lost_at: float | None = None
        retries = 0
        while True:
            try:
                async with aclosing(self._backend.generate(self._submission(), self.request_id,
                                                           self._trace_id)) as events:
                    async for event in events:
                        if lost_at is not None:
                            self._log_resumed(lost_at)
                            lost_at, retries = None, 0
                        self.received.extend(token.token_id for token in event.tokens)
                        yield event
                return
            except BackendError as error:
                lost_at = self._recovering_since(error, lost_at)
            await asyncio.sleep(self._backoff(lost_at, retries))
            retries += 1
            self.submissions += 1
            self.request_id = f"{self._first_id}.r{self.submissions - 1}"

    async def cancel(self) -> bool:
        """Cancels the current submission; a loss after this is not recovered."""
        self._cancelled = True
        return await self._backend.cancel(self.request_id)

    def _submission(self) -> GenerationSpec:
        """The spec to send: after a loss, marked as admitted before (the tenant's
        limits neither refuse nor charge it again), with what was received so far."""
        if self.submissions == 1:
            return self._spec
        return replace(self._spec, resume_token_ids=tuple(self.received), resubmitted=True)

    def _recovering_since(self, error: BackendError, lost_at: float | None) -> float:
        """When the scheduler was lost: now, for a first loss. Raises `error` when
        the request is not to be submitted again: it was cancelled, recovery is
        off, the error is a refusal (outside a recovery, or one that no restart
        explains), the gateway has never reached its scheduler (nothing to wait
        for), or SCHEDULER_RECOVERY_S has passed since the loss."""
        now = self._clock()
        if lost_at is None:
            if self._cancelled or self._recovery_s <= 0 or not isinstance(error, SchedulerLost) \
                    or not self._backend.scheduler_seen:
                raise error
            log.warning("lost the scheduler; waiting for it to resume the request", extra={
                "scheduler_request_id": self.request_id, "received_tokens": len(self.received),
                "error": error.message, "recovery_s": self._recovery_s})
            return now
        if self._cancelled or not isinstance(error, (Unavailable, Overloaded)) \
                or now - lost_at >= self._recovery_s:
            raise error
        return lost_at

    def _backoff(self, lost_at: float, retries: int) -> float:
        """Seconds to wait before the next submission: doubling, at most
        MAX_RETRY_S, and never past the recovery deadline."""
        left = lost_at + self._recovery_s - self._clock()
        return max(0.0, min(FIRST_RETRY_S * 2 ** min(retries, 10), MAX_RETRY_S, left))

    def _log_resumed(self, lost_at: float) -> None:
        log.info("request resumed after losing the scheduler", extra={
            "scheduler_request_id": self.request_id, "resumed_tokens": len(self.received),
            "waited_s": round(self._clock() - lost_at, 3), "submissions": self.submissions})
