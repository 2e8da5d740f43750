"""Which running request gives way: to make room in the pool (the preemption
victim), and to hand its batch slot to a waiting request when the batch is
full (slot fairness).

Invariants:
- The preemption order is running_key descending: lowest priority first, then
  the latest arrival. The key is unique per request, so the order is total.
- A slot only ever moves to a higher priority, or (under vtc) from a client
  above its fair share to one below it, so two requests cannot keep taking
  a slot from each other.
- A request admitted in the step being planned never gives its slot away in
  that same step.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Sequence

from services.scheduler.core.state import RequestState
from services.scheduler.core.types import Policy


def preemption_victim(running: Sequence[RequestState]) -> RequestState:
    """The running request preempted first. `running` must not be empty."""
    return max(running, key=lambda r: r.running_key)


def fair_share(max_batch_size: int, num_clients: int) -> float:
    """Batch slots per client when the batch is split evenly between the
    clients with work on the worker."""
    return max_batch_size / num_clients


def slot_victim(candidate: RequestState, running: Sequence[RequestState], pending: Sequence[RequestState],
                admitted_now: Collection[str], policy: Policy, max_batch_size: int) -> RequestState | None:
    """The running request that gives its batch slot to `candidate` when the
    batch is full, if any; `admitted_now` holds the seq_ids admitted in the
    step being planned. A lower-priority request always yields (the latest of
    the lowest priority). Under vtc, a client holding more than its fair share
    of slots (max_batch_size over the clients with work on this worker) yields
    its latest arrival to a client holding less; the victim keeps its tokens,
    and its cached blocks make the recompute cheap."""
    movable = [r for r in running if r.seq_id not in admitted_now]
    lower = [r for r in movable if r.priority < candidate.priority]
    if lower:
        return preemption_victim(lower)
    if policy is not Policy.VTC:
        return None
    slots = Counter(r.client_id for r in running)
    clients = set(slots) | {r.client_id for r in pending}
    share = fair_share(max_batch_size, len(clients))
    if slots[candidate.client_id] + 1 > share:
        return None     # the candidate's client would go over its own share
    over_share = [r for r in movable if r.priority == candidate.priority
                  and slots[r.client_id] - 1 >= share
                  and r.client_id != candidate.client_id]
    if not over_share:
        return None
    # The client furthest over its share gives up its latest arrival.
    return max(over_share, key=lambda r: (slots[r.client_id], r.arrival_order))
