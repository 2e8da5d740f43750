"""Steps sent to a worker and not yet applied (async scheduling plans the
next step while the worker computes this one): what planning assumes they do
to their requests, and how that assumption is retired once a step's outcome
arrives.

Invariants, for every running request:
- num_computed counts the tokens of every step in flight as computed;
- inflight_samples is the number of steps in flight expected to end with a
  sample for it (their chunk reaches every token the worker will hold);
- inflight_drafts is the sum of the tokens beyond one sample that those steps
  may bring it (their drafts, and their further decodes: WorkItem.extra_tokens).
A request preempted, finished or moved to another worker while a step ran has
had these reset (RequestBook.detach); retiring that step leaves it alone.
"""

from __future__ import annotations

from collections.abc import Mapping

from services.scheduler.core.state import InFlightStep, RequestState
from common.step import StepBatch


def dispatch(step: StepBatch, by_seq: Mapping[str, RequestState]) -> frozenset[str]:
    """Counts a planned step's work as done; returns the sequences it should sample."""
    sampling = set()
    for item in step.work:
        request = by_seq[item.seq_id]
        request.num_computed += item.num_tokens
        request.inflight_drafts += item.extra_tokens
        if request.num_computed >= request.worker_tokens:
            request.inflight_samples += 1
            sampling.add(item.seq_id)
    return frozenset(sampling)


def retire(done: InFlightStep, by_seq: Mapping[str, RequestState], worker_id: str) -> None:
    """Takes a step that ran out of its requests' in-flight counts (only
    those still running on `worker_id`; the others were reset)."""
    for seq_id in done.sampling:
        request = by_seq.get(seq_id)
        if request is not None and request.worker_id == worker_id:
            request.inflight_samples -= 1
    for item in done.plan.work:
        request = by_seq.get(item.seq_id)
        if item.extra_tokens and request is not None and request.worker_id == worker_id:
            request.inflight_drafts -= item.extra_tokens
