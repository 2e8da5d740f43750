"""Requests that wait for a worker: while no worker serves (the last one died,
or every one is draining), what was running or queued is held here, and new
requests queue here within the gates, each for up to WORKER_RECOVERY_S. When
a worker registers, the core takes everything back: held requests are
resumed by recompute exactly as failover.py does (same tokens, usage and
seeds), parked arrivals are submitted as if they had just come. Past its
deadline a request ends with an error naming the setting.

Two kinds are kept:
- held: RequestStates that failover could not place (failover.Stranded
  semantics: fresh ones and the waiting resumable ones are still counted as
  waiting; the running ones are detached and not);
- parked: RequestSpecs of requests that arrived while no worker served. They
  have passed the early gates and their tenant's quota (which they hold); the
  checks that need a worker's shape run when one registers.

Pure: no transport; the caller passes the time.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from services.scheduler.core.faults.failover import Stranded
from services.scheduler.core.request_book import RequestBook
from services.scheduler.core.state import Phase, RequestState
from services.scheduler.core.types import FinishReason, Gate, Rejection, RequestSpec, RequestUpdate


@dataclass(frozen=True)
class Parked:
    spec: RequestSpec
    cached_prefix_tokens: Mapping[str, int]
    since_s: float


@dataclass
class _Held:
    request: RequestState
    fresh: bool          # never ran (failover's Stranded.fresh)
    since_s: float
    reason: str          # why it lost its worker


@dataclass(frozen=True)
class Overdue:
    """What waited past WORKER_RECOVERY_S, to be ended by the core."""
    stranded: Stranded = field(default_factory=Stranded)
    parked: tuple[Parked, ...] = ()
    reasons: Mapping[str, str] = field(default_factory=dict)   # request_id -> why it lost its worker


class WorkerRecovery:
    def __init__(self, recovery_s: float) -> None:
        self.recovery_s = recovery_s
        self._held: dict[str, _Held] = {}
        self._parked: dict[str, Parked] = {}

    @property
    def enabled(self) -> bool:
        return self.recovery_s > 0

    def __len__(self) -> int:
        return len(self._held) + len(self._parked)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._held or request_id in self._parked

    def oldest_s(self) -> float | None:
        """When the longest-waiting request started waiting, or None when none waits."""
        times = [h.since_s for h in self._held.values()] + [p.since_s for p in self._parked.values()]
        return min(times) if times else None

    def hold(self, stranded: Stranded, reason: str, now: float) -> None:
        """Keeps requests failover could not place until a worker registers."""
        for request in stranded.fresh:
            request.worker_id = ""
            self._held[request.request_id] = _Held(request, True, now, reason)
        for request in stranded.resumable:
            request.worker_id = ""
            self._held[request.request_id] = _Held(request, False, now, reason)

    def park(self, spec: RequestSpec, cached_prefix_tokens: Mapping[str, int], now: float) -> None:
        """Queues a new request that arrived while no worker serves."""
        self._parked[spec.request_id] = Parked(spec, dict(cached_prefix_tokens), now)

    def take_all(self) -> tuple[Stranded, list[Parked]]:
        """Everything that waits, in arrival order, to be placed on a worker now."""
        stranded = self._stranded(self._held.values())
        parked = sorted(self._parked.values(), key=lambda p: p.since_s)
        self._held, self._parked = {}, {}
        return stranded, parked

    def take(self, request_id: str) -> RequestState | Parked | None:
        """Removes one request (it is cancelled or ended) and returns it."""
        held = self._held.pop(request_id, None)
        if held is not None:
            return held.request
        return self._parked.pop(request_id, None)

    def overdue(self, now: float) -> Overdue:
        """Removes and returns what waited longer than recovery_s."""
        late_held = [h for h in self._held.values() if now - h.since_s > self.recovery_s]
        late_parked = tuple(p for p in self._parked.values() if now - p.since_s > self.recovery_s)
        for held in late_held:
            del self._held[held.request.request_id]
        for parked in late_parked:
            del self._parked[parked.spec.request_id]
        return Overdue(self._stranded(late_held), late_parked,
                       {h.request.request_id: h.reason for h in late_held})

    def deadline_message(self, reason: str = "") -> str:
        head = f"{reason}; " if reason else ""
        return f"{head}no worker registered within WORKER_RECOVERY_S={self.recovery_s:g} s to serve it"

    def end_overdue(self, now: float, book: RequestBook) -> list[RequestUpdate]:
        """Ends what waited past recovery_s: running ones with an error, waiting ones
        rejected (Gate.NO_WORKER), each with a message naming WORKER_RECOVERY_S."""
        late = self.overdue(now)
        updates: list[RequestUpdate] = []
        for request in late.stranded.resumable:
            if request.phase is Phase.PENDING:       # preempted before: still counted as waiting
                book.waiting.leave(request.client_id, request.user)
            message = self.deadline_message(late.reasons.get(request.request_id, ""))
            finish = book.finish(None, request, FinishReason.ERROR, message)
            updates.append(RequestUpdate(request.request_id, finish=finish))
        for request in late.stranded.fresh:
            message = self.deadline_message(late.reasons.get(request.request_id, ""))
            updates.append(book.reject(None, request, Gate.NO_WORKER, message))
        for parked in late.parked:
            if book.quotas is not None:
                book.quotas.release(parked.spec.request_id)
            book.counts.count_rejection(Gate.NO_WORKER)
            rejection = Rejection(Gate.NO_WORKER, self.deadline_message())
            updates.append(RequestUpdate(parked.spec.request_id, rejection=rejection))
        return updates

    def forget(self, request_id: str, book: RequestBook) -> RequestState | Parked | None:
        """Takes out one request that ends otherwise (cancelled, past max_request_s): a
        held one stops counting as waiting (the caller ends it), a parked one lets go of
        its quota."""
        item = self.take(request_id)
        if isinstance(item, RequestState) and item.phase is Phase.PENDING:
            book.waiting.leave(item.client_id, item.user)
        elif isinstance(item, Parked) and book.quotas is not None:
            book.quotas.release(request_id)
        return item

    @staticmethod
    def _stranded(held: Iterable[_Held]) -> Stranded:
        items = sorted(held, key=lambda h: h.request.arrival_order)
        return Stranded(fresh=[h.request for h in items if h.fresh],
                        resumable=[h.request for h in items if not h.fresh])
