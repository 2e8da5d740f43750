"""Every request the core knows and the moves between its worker's lists:
enqueue (pending), admit (pending -> prefilling), activate (prefilling ->
active), preempt (back to pending), and out: finish, reject. The book keeps
the maps and counts consistent with each move; when to make a move is the
scheduler's decision.

Invariants between the core's calls:
- `requests` holds every request not yet finished or rejected, by request_id.
- A request sits in exactly one of its worker's pending, prefilling and
  active lists: the one its phase names. (Failover moves requests between
  workers and restores this before it returns.)
- `by_seq` maps the seq_id of every prefilling or active request, and nothing else.
- The waiting count of a client (WaitingClients) is its number of pending
  requests, and that of a user within the client its number of pending requests.
- A worker's reserved_kv_tokens is the sum of kv_reservation over its
  prefilling and active requests.
- A request's hold on its tenant's quota (core/quotas.py) ends with it.
"""

from __future__ import annotations

from dataclasses import replace

from common.types import SamplingParams, Usage

from services.scheduler.core.fairness.counters import CoreCounters
from services.scheduler.core.fairness.vtc import VirtualTokenCounter
from services.scheduler.core.fairness.policy import WaitingClients
from services.scheduler.core.fairness.quotas import TenantQuotas
from services.scheduler.core.state import Phase, RequestState, WorkerState
from services.scheduler.core.step_builder import StepBuilder
from services.scheduler.core.types import Finish, FinishReason, Gate, Rejection, RequestUpdate
from common.step import NewSequence

# Past this many clients with a VTC counter, the idle ones are forgotten (down to
# half); likewise past this many users with a counter within one client.
MAX_TRACKED_CLIENTS = 10000
MAX_TRACKED_USERS = 1000


def worker_sampling(request: RequestState) -> SamplingParams:
    """The request's sampling settings plus what the worker must ban until
    min_tokens: a stop token sampled early would be generated and then ignored."""
    spec = request.spec
    if spec.min_tokens <= 0:
        return spec.sampling
    return replace(spec.sampling, min_tokens=spec.min_tokens,
                   stop_token_ids=tuple(sorted(spec.stop_token_ids)))


class RequestBook:
    def __init__(self, vtc: VirtualTokenCounter, counts: CoreCounters,
                 quotas: TenantQuotas | None = None) -> None:
        self.requests: dict[str, RequestState] = {}
        self.quotas = quotas
        self.by_seq: dict[str, RequestState] = {}
        self.vtc = vtc
        self.waiting = WaitingClients(vtc)
        self.counts = counts

    # ---- in ----

    def add(self, worker: WorkerState, request: RequestState) -> None:
        """A new request, queued on `worker`; its weight becomes its client's."""
        self.requests[request.request_id] = request
        self.vtc.set_weight(request.client_id, request.weight)
        self.enqueue(worker, request, arriving=True)

    def enqueue(self, worker: WorkerState, request: RequestState, arriving: bool = False) -> None:
        """Queues `request` on `worker`: a new arrival, or one admitted before."""
        request.phase = Phase.PENDING
        worker.pending.append(request)
        if arriving:
            self.waiting.arrive(request.client_id, request.user)
        else:
            self.waiting.requeue(request.client_id, request.user)

    def dequeue(self, worker: WorkerState, request: RequestState) -> None:
        worker.pending.remove(request)
        self.waiting.leave(request.client_id, request.user)

    def admit(self, worker: WorkerState, request: RequestState, seq_id: str, now: float) -> NewSequence:
        """pending -> prefilling, as a new sequence the worker must register; the
        first admission records the queue wait and charges the client's prompt."""
        if not request.admitted_once:
            request.admitted_once = True
            request.queue_wait_s = now - request.arrival_s
            self.counts.count_admission(request.queue_wait_s)
            self.vtc.charge_prompt(request.client_id, len(request.prompt), request.user)
        self.dequeue(worker, request)
        request.seq_id, request.num_computed, request.phase = seq_id, 0, Phase.PREFILLING
        worker.prefilling.append(request)
        worker.reserved_kv_tokens += request.kv_reservation
        self.by_seq[seq_id] = request
        return NewSequence(seq_id=seq_id, prompt_token_ids=request.prompt,
                           output_token_ids=tuple(request.output), sampling=worker_sampling(request),
                           cache_salt=request.spec.cache_salt, kv_policy=request.kv_policy,
                           lora_name=request.spec.lora_name, lora_path=request.spec.lora_path,
                           lora_digest=request.spec.lora_digest)

    def activate(self, worker: WorkerState, request: RequestState) -> None:
        """prefilling -> active, once it has sampled a token (no-op when active)."""
        if request.phase is Phase.PREFILLING:
            worker.prefilling.remove(request)
            worker.active.append(request)
            request.phase = Phase.ACTIVE

    # ---- back and out ----

    def detach(self, worker: WorkerState, request: RequestState, plan: StepBuilder | None = None) -> None:
        """Takes a request out of its worker's lists and frees its sequence (in
        `plan` when one is being built, else in the next step)."""
        if request.phase is Phase.PENDING:
            self.dequeue(worker, request)
            return
        (worker.prefilling if request.phase is Phase.PREFILLING else worker.active).remove(request)
        worker.reserved_kv_tokens -= request.kv_reservation
        if request.seq_id is not None:
            seq_id, blocks = request.seq_id, worker.blocks_held(request)
            del self.by_seq[seq_id]
            if plan is not None:
                plan.free(seq_id, blocks)
            else:
                worker.free_in_next_step(seq_id, blocks)
        request.seq_id, request.num_computed, request.inflight_samples = None, 0, 0
        request.inflight_drafts = 0

    def preempt(self, worker: WorkerState, request: RequestState, plan: StepBuilder | None = None) -> None:
        """Back to the front of the queue; it keeps its tokens and is recomputed
        from prompt + output when admitted again."""
        self.detach(worker, request, plan)
        request.resumed = True
        self.enqueue(worker, request)
        self.counts.preemptions += 1

    def finish(self, worker: WorkerState | None, request: RequestState, reason: FinishReason,
               message: str = "") -> Finish:
        """Ends a request; `worker` None: it is in no worker's lists any more."""
        if worker is not None:
            self.detach(worker, request)
        self.requests.pop(request.request_id, None)
        self._release(request)
        self.counts.count_finish(reason)
        self._forget_idle(request.client_id)
        usage = Usage(prompt_tokens=len(request.prompt), completion_tokens=len(request.output),
                      cached_tokens=request.cached_tokens or 0)
        return Finish(reason=reason, usage=usage, message=message, queue_wait_s=request.queue_wait_s)

    def reject(self, worker: WorkerState | None, request: RequestState, gate: Gate,
               message: str) -> RequestUpdate:
        """Rejects a waiting request; `worker` None: it is out of its worker's
        queue already, and only still counted as waiting."""
        if worker is not None:
            worker.pending.remove(request)
        self.waiting.leave(request.client_id, request.user)
        self.requests.pop(request.request_id, None)
        self._release(request)
        self.counts.count_rejection(gate)
        return RequestUpdate(request.request_id, rejection=Rejection(gate, message))

    def _release(self, request: RequestState) -> None:
        if self.quotas is not None:
            self.quotas.release(request.request_id)

    def _forget_idle(self, client_id: str) -> None:
        """Bounds the counters kept: idle clients (no request left) past
        MAX_TRACKED_CLIENTS, idle users of `client_id` past MAX_TRACKED_USERS.
        A forgotten one starts again from the floor on its next arrival."""
        if len(self.vtc) > MAX_TRACKED_CLIENTS:
            busy = {r.client_id for r in self.requests.values()}
            idle = [c.client_id for c in self.vtc.snapshot() if c.client_id not in busy]
            self.vtc.forget(idle[: len(self.vtc) - MAX_TRACKED_CLIENTS // 2])
        if self.vtc.num_users(client_id) > MAX_TRACKED_USERS:
            users = self.vtc.users(client_id)
            busy_users = {r.user for r in self.requests.values() if r.client_id == client_id}
            idle_users = [u for u in users if u not in busy_users]
            self.vtc.forget_users(client_id, idle_users[: len(users) - MAX_TRACKED_USERS // 2])
