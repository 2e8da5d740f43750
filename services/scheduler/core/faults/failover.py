"""Requests of a worker that is gone (removed, silent past the heartbeat
timeout, or registered again after a restart) move to the workers left.

Requests that never ran move as they are, to wait on another worker. Requests
that ran there (running ones, and preempted ones waiting to run again) are
resumed on another worker by recompute from their prompt and the tokens
already streamed, so their clients see no gap and no repeat. With no worker
left the core holds them until one registers (recovery.py, WORKER_RECOVERY_S);
with recovery off, or no worker that could ever fit a resumed request, it ends
with an error; a request that never ran is rejected.

A request running on a worker that fails may be what failed it (a poison
request that crashes every worker it runs on). Each such move counts as a
failover of the request; one that has already failed over `max_migrations`
times (MAX_MIGRATIONS) ends with an error instead of moving on. Moves of a
worker leaving on purpose (drain) do not count.

Invariant: between release() and rehome() the stranded requests are in no
worker's lists, and the ones that were waiting are still counted as waiting
(WaitingClients); rehome() puts each one in exactly one place again, or ends it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from services.scheduler.core.gates import never_fit
from services.scheduler.core.request_book import RequestBook
from services.scheduler.core.routing import SessionMap, choose_worker, session_key
from services.scheduler.core.state import Phase, RequestState, WorkerState
from services.scheduler.core.types import FinishReason, Gate, RequestUpdate


@dataclass
class Stranded:
    fresh: list[RequestState] = field(default_factory=list)      # never ran; counted as waiting
    resumable: list[RequestState] = field(default_factory=list)  # ran there; the waiting ones still counted


class Failover:
    def __init__(self, book: RequestBook, sessions: SessionMap, max_active_kv_tokens: int,
                 max_migrations: int = 2) -> None:
        self._book = book
        self._sessions = sessions
        self._max_active_kv_tokens = max_active_kv_tokens
        self._max_migrations = max_migrations

    def release(self, worker: WorkerState) -> Stranded:
        """Empties a worker that is gone: its running requests are detached, its
        queue emptied, its sessions forgotten."""
        fresh = [r for r in worker.pending if not r.admitted_once]
        resumable = [r for r in worker.pending if r.admitted_once]
        worker.pending = []
        running = worker.running
        for request in running:
            self._book.detach(worker, request)
            request.resumed = True
        worker.take_frees()    # the worker is gone: nothing to free there
        self._sessions.forget_worker(worker.worker_id)
        return Stranded(fresh, resumable + running)

    def rehome(self, stranded: Stranded, workers: Sequence[WorkerState], reason: str,
               failed: bool = False) -> list[RequestUpdate]:
        """Moves the stranded requests to `workers`; returns the updates for those that end.
        `failed`: their worker failed, so each request running there counts a failover."""
        updates: list[RequestUpdate] = []
        for request in stranded.resumable:
            updates.extend(self._migrate(request, workers, reason, failed))
        for request in stranded.fresh:
            updates.extend(self._reroute(request, workers))
        return updates

    def count_failures(self, stranded: Stranded, reason: str) -> list[RequestUpdate]:
        """Counts a failover of each request that was running on a failed worker, before
        they wait for another (recovery.py); ends those past MAX_MIGRATIONS, which
        leave `stranded`. The ones kept are later moved with failed=False."""
        updates: list[RequestUpdate] = []
        for request in list(stranded.resumable):
            if request.phase is Phase.PENDING:
                continue      # preempted before: it was not running there
            problem = self._failover_limit(request)
            if problem:
                stranded.resumable.remove(request)
                request.worker_id = ""
                finish = self._book.finish(None, request, FinishReason.ERROR, f"{reason}; {problem}")
                updates.append(RequestUpdate(request.request_id, finish=finish))
        return updates

    def _migrate(self, request: RequestState, workers: Sequence[WorkerState], reason: str,
                 failed: bool = False) -> list[RequestUpdate]:
        """Queues a request that ran on the gone worker on another one, to be
        resumed from its prompt and the tokens it has produced."""
        waiting = request.phase is Phase.PENDING     # preempted before: still counted as waiting
        target = choose_worker(workers, None, {})
        problem = "no worker is left to resume it" if target is None else never_fit(
            target.spec, len(request.prompt), request.max_tokens, self._max_active_kv_tokens)
        if failed and not waiting:
            problem = problem or self._failover_limit(request)
        if problem:
            if waiting:
                self._book.waiting.leave(request.client_id, request.user)
            request.worker_id = ""
            finish = self._book.finish(None, request, FinishReason.ERROR, f"{reason}; {problem}")
            return [RequestUpdate(request.request_id, finish=finish)]
        assert target is not None
        self._move_to(target, request, counted_as_waiting=waiting)
        self._book.counts.migrations += 1
        return []

    def _failover_limit(self, request: RequestState) -> str:
        """Counts a failover of a request that was running; past the limit, why it ends."""
        if request.failovers >= self._max_migrations:
            return (f"the request was running on {request.failovers + 1} workers that failed "
                    f"(MAX_MIGRATIONS={self._max_migrations}); it is not moved again")
        request.failovers += 1
        return ""

    def _reroute(self, request: RequestState, workers: Sequence[WorkerState]) -> list[RequestUpdate]:
        """Moves a request that was only waiting to another worker."""
        target = choose_worker(workers, None, {})
        if target is None:
            return [self._book.reject(None, request, Gate.NO_WORKER, "no worker is left to serve the request")]
        self._move_to(target, request, counted_as_waiting=True)
        return []

    def _move_to(self, target: WorkerState, request: RequestState, counted_as_waiting: bool) -> None:
        """Queues `request` on `target`; its session follows it."""
        request.worker_id = target.worker_id
        if request.spec.session_id:
            self._sessions.remember(session_key(request.spec), target.worker_id)
        if counted_as_waiting:
            target.pending.append(request)
        else:
            self._book.enqueue(target, request)
