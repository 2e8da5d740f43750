"""Admission order: priority first, then FCFS or the Virtual Token Counter
(weighted, two-level: core/vtc.py).

Under vtc the waiting client with the smallest client counter goes first;
within it, the user with the smallest user counter; within the user, the
queue order (a preempted request first, then arrival). Requests without a
user form one user "" per client, so without users this is the one-level
VTC: the client's first request in queue order.

WaitingClients keeps the waiting counts that drive the lifts. Invariants:
- Only clients, and users within a client, with something waiting are kept.
- A client whose count goes from 0 to 1 on an arrival is lifted among the
  waiting clients; a user likewise among its client's waiting users. A
  requeue (a request admitted before, coming back) lifts neither.
- Whoever's count drops to 0 is noted as the last departure of its level.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from services.scheduler.core.state import RequestState
from services.scheduler.core.types import Policy
from services.scheduler.core.fairness.vtc import VirtualTokenCounter


class WaitingClients:
    """Requests waiting for admission per client and per user within it, kept
    in step with the VTC."""

    def __init__(self, vtc: VirtualTokenCounter) -> None:
        self._vtc = vtc
        self._waiting: Counter[str] = Counter()
        self._users: dict[str, Counter[str]] = {}

    def arrive(self, client_id: str, user: str = "") -> None:
        """A new request queues."""
        if self._waiting[client_id] == 0:
            self._vtc.lift_on_arrival(client_id, list(self._waiting))
        users = self._users.setdefault(client_id, Counter())
        if users[user] == 0:
            self._vtc.lift_user_on_arrival(client_id, user, list(users))
        self._count(client_id, user, users)

    def requeue(self, client_id: str, user: str = "") -> None:
        """A request that was admitted before queues again (no lift: it was served)."""
        self._count(client_id, user, self._users.setdefault(client_id, Counter()))

    def leave(self, client_id: str, user: str = "") -> None:
        """A request leaves the queue: admitted, rejected or finished."""
        users = self._users[client_id]
        users[user] -= 1
        if users[user] <= 0:
            del users[user]
            self._vtc.note_user_departure(client_id, user)
        self._waiting[client_id] -= 1
        if self._waiting[client_id] <= 0:
            del self._waiting[client_id]
            del self._users[client_id]
            self._vtc.note_departure(client_id)

    def waiting(self, client_id: str) -> int:
        return self._waiting[client_id]

    def waiting_users(self, client_id: str) -> dict[str, int]:
        """The client's users with something waiting, and how many requests each."""
        return dict(self._users.get(client_id, {}))

    def _count(self, client_id: str, user: str, users: Counter[str]) -> None:
        users[user] += 1
        self._waiting[client_id] += 1

    def __len__(self) -> int:
        """Clients with at least one request waiting."""
        return len(self._waiting)


def _queue_position(request: RequestState) -> tuple[int, int]:
    # A preempted request goes back to the front of its queue.
    return (0 if request.resumed else 1, request.arrival_order)


def effective_policy(policy: Policy, *groups: Iterable[RequestState]) -> Policy:
    """The policy a decision among `groups` (a worker's waiting and running
    requests) follows: auto is the VTC as soon as one of them carries an
    authenticated tenant (the gateway has API keys), FCFS otherwise."""
    if policy is not Policy.AUTO:
        return policy
    authenticated = any(request.spec.authenticated for group in groups for request in group)
    return Policy.VTC if authenticated else Policy.FCFS


def pick_next(pending: Sequence[RequestState], policy: Policy,
              vtc: VirtualTokenCounter) -> RequestState | None:
    """The request to admit next; priority sits above either policy."""
    if not pending:
        return None
    top = max(r.priority for r in pending)
    candidates = [r for r in pending if r.priority == top]
    if policy is Policy.VTC:
        return _pick_by_counters(candidates, vtc)
    return min(candidates, key=_queue_position)


def _pick_by_counters(candidates: Sequence[RequestState], vtc: VirtualTokenCounter) -> RequestState:
    """The client with the smallest counter (ties: queue order), then its user
    with the smallest user counter (ties: queue order), then that user's
    first request in queue order."""
    first_by_user: dict[tuple[str, str], RequestState] = {}
    for request in sorted(candidates, key=_queue_position):
        first_by_user.setdefault((request.client_id, request.user), request)
    # A client's first request is the first of its users' first requests.
    client_id = min(first_by_user.values(),
                    key=lambda r: (vtc.counter(r.client_id), _queue_position(r))).client_id
    return min((r for (c, _), r in first_by_user.items() if c == client_id),
               key=lambda r: (vtc.user_counter(client_id, r.user), _queue_position(r)))
