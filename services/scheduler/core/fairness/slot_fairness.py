"""Which running request gives way: to make room in the pool (the preemption
victim), and to hand its batch slot to a waiting request when the batch is
full (slot fairness).

Slot fairness works at the client level: a client's fair share of the batch
is max_batch_size x its weight over the summed weights of the clients with
work (running or waiting) on the worker. Users within a client share its
slots and never take one from each other, so a client spreading its
requests over many users gets no more slots than one with a single user.

Invariants:
- The preemption order is running_key descending: lowest priority first, then
  the latest arrival. The key is unique per request, so the order is total.
- A slot only ever moves to a higher priority, or (under vtc) from a client
  that stays at or above its fair share to one that stays at or below its
  own, so two requests cannot keep taking a slot from each other.
- A request admitted in the step being planned never gives its slot away in
  that same step.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence

from services.scheduler.core.state import RequestState
from services.scheduler.core.types import Policy

# Shares are fractions of slots: compare them with room for rounding.
_EPS = 1e-9


def preemption_victim(running: Sequence[RequestState]) -> RequestState:
    """The running request preempted first. `running` must not be empty."""
    return max(running, key=lambda r: r.running_key)


def client_weights(requests: Iterable[RequestState]) -> dict[str, float]:
    """Each client's weight: the one its latest-arrived request carries."""
    latest: dict[str, RequestState] = {}
    for request in requests:
        seen = latest.get(request.client_id)
        if seen is None or request.arrival_order > seen.arrival_order:
            latest[request.client_id] = request
    return {client_id: request.weight for client_id, request in latest.items()}


def fair_shares(max_batch_size: int, weights: Mapping[str, float]) -> dict[str, float]:
    """Batch slots per client when the batch is split between the clients in
    proportion to their weights."""
    total = sum(weights.values())
    return {client_id: max_batch_size * weight / total for client_id, weight in weights.items()}


def slot_victim(candidate: RequestState, running: Sequence[RequestState], pending: Sequence[RequestState],
                admitted_now: Collection[str], policy: Policy, max_batch_size: int) -> RequestState | None:
    """The running request that gives its batch slot to `candidate` when the
    batch is full, if any; `admitted_now` holds the seq_ids admitted in the
    step being planned. A lower-priority request always yields (the latest of
    the lowest priority). Under vtc, a client holding more than its fair share
    of slots yields its latest arrival to a client holding less; the victim
    keeps its tokens, and its cached blocks make the recompute cheap."""
    movable = [r for r in running if r.seq_id not in admitted_now]
    lower = [r for r in movable if r.priority < candidate.priority]
    if lower:
        return preemption_victim(lower)
    if policy is not Policy.VTC:
        return None
    slots = Counter(r.client_id for r in running)
    shares = fair_shares(max_batch_size, client_weights([*running, *pending, candidate]))
    if slots[candidate.client_id] + 1 > shares[candidate.client_id] + _EPS:
        return None     # the candidate's client would go over its own share
    over_share = [r for r in movable if r.priority == candidate.priority
                  and slots[r.client_id] - 1 >= shares[r.client_id] - _EPS
                  and r.client_id != candidate.client_id]
    if not over_share:
        return None
    # The client furthest over its share gives up its latest arrival.
    return max(over_share, key=lambda r: (slots[r.client_id] - shares[r.client_id], r.arrival_order))
