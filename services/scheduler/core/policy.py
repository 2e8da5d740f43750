"""Admission order: priority first, then FCFS or the Virtual Token Counter.

VTC (Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024):
each client has a counter charged input_weight x prompt tokens at admission
and output_weight per generated token. A client that arrives with nothing
waiting is lifted to the smallest counter among the clients that are
waiting (or, when nobody waits, to the counter of the client that last left
the queue), so idling earns no credit. Admission goes to the waiting client
with the smallest counter.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from services.scheduler.core.state import RequestState
from services.scheduler.core.types import ClientCounter, Policy


class VirtualTokenCounter:
    def __init__(self, input_weight: float, output_weight: float) -> None:
        self._input_weight = input_weight
        self._output_weight = output_weight
        self._counters: dict[str, float] = {}
        self._served_tokens: dict[str, int] = {}
        self._last_departed: float | None = None

    def counter(self, client_id: str) -> float:
        return self._counters.get(client_id, 0.0)

    def lift_on_arrival(self, client_id: str, waiting_clients: Iterable[str]) -> None:
        others = [self.counter(c) for c in waiting_clients if c != client_id]
        floor = min(others) if others else self._last_departed
        current = self._counters.get(client_id, 0.0)
        self._counters[client_id] = current if floor is None else max(current, floor)
        self._served_tokens.setdefault(client_id, 0)

    def note_departure(self, client_id: str) -> None:
        """The client's last waiting request left the queue."""
        self._last_departed = self.counter(client_id)

    def charge_prompt(self, client_id: str, num_tokens: int) -> None:
        self._counters[client_id] = self.counter(client_id) + self._input_weight * num_tokens
        self._served_tokens[client_id] = self._served_tokens.get(client_id, 0) + num_tokens

    def charge_output(self, client_id: str, num_tokens: int = 1) -> None:
        self._counters[client_id] = self.counter(client_id) + self._output_weight * num_tokens
        self._served_tokens[client_id] = self._served_tokens.get(client_id, 0) + num_tokens

    def forget(self, client_ids: Iterable[str]) -> None:
        for client_id in client_ids:
            self._counters.pop(client_id, None)
            self._served_tokens.pop(client_id, None)

    def snapshot(self) -> tuple[ClientCounter, ...]:
        return tuple(ClientCounter(client_id=c, counter=self._counters[c],
                                   served_tokens=self._served_tokens.get(c, 0))
                     for c in sorted(self._counters))

    def __len__(self) -> int:
        return len(self._counters)


class WaitingClients:
    """Requests waiting for admission per client, kept in step with the VTC:
    a client's request arriving while none of its requests waits lifts its
    counter, and the client whose last waiting request leaves the queue is
    noted as the last departure. Only clients with something waiting are kept."""

    def __init__(self, vtc: VirtualTokenCounter) -> None:
        self._vtc = vtc
        self._waiting: Counter[str] = Counter()

    def arrive(self, client_id: str) -> None:
        """A new request queues."""
        if self._waiting[client_id] == 0:
            self._vtc.lift_on_arrival(client_id, list(self._waiting))
        self._waiting[client_id] += 1

    def requeue(self, client_id: str) -> None:
        """A request that was admitted before queues again (no lift: its client
        was served)."""
        self._waiting[client_id] += 1

    def leave(self, client_id: str) -> None:
        """A request leaves the queue: admitted, rejected or finished."""
        self._waiting[client_id] -= 1
        if self._waiting[client_id] <= 0:
            del self._waiting[client_id]
            self._vtc.note_departure(client_id)

    def waiting(self, client_id: str) -> int:
        return self._waiting[client_id]

    def __len__(self) -> int:
        """Clients with at least one request waiting."""
        return len(self._waiting)


def _queue_position(request: RequestState) -> tuple[int, int]:
    # A preempted request goes back to the front of its queue.
    return (0 if request.resumed else 1, request.arrival_order)


def pick_next(pending: Sequence[RequestState], policy: Policy,
              vtc: VirtualTokenCounter) -> RequestState | None:
    """The request to admit next; priority sits above either policy."""
    if not pending:
        return None
    top = max(r.priority for r in pending)
    candidates = [r for r in pending if r.priority == top]
    if policy is Policy.VTC:
        first_by_client: dict[str, RequestState] = {}
        for request in sorted(candidates, key=_queue_position):
            first_by_client.setdefault(request.client_id, request)
        return min(first_by_client.values(),
                   key=lambda r: (vtc.counter(r.client_id), _queue_position(r)))
    return min(candidates, key=_queue_position)
