"""The scheduling core: the loop that plans each worker's steps, applies their
results and moves requests through their lifecycle. Pure and synchronous; the
transport calls it from one event loop, feeds it step outcomes and delivers
the request updates it returns.

Life of a request: submit() puts it in its worker's pending queue (or
rejects it). plan_step() admits pending requests under the gates, sends
their prompts in chunks (prefilling), then one decode per step (active).
apply_step() turns the worker's results into token events and finishes.
A sequence that loses its blocks to a preemption goes back to pending with
its generated tokens and is later recomputed from prompt + output.

The decisions live in their own modules, which take plain values: routing
(which worker), gates (reject, hold, time out), policy (admission order and
the VTC), prefix_share (followers wait for a leader's blocks), slot_fairness
(who gives up a slot, who is preempted first), room (blocks to grow, victims
to make room), speculation (the draft allowance), stopping (finish reasons).
So does the bookkeeping: request_book (the moves between a worker's lists),
step_planner (what goes into a step), step_builder (one step's budgets), in_flight (steps sent, not yet applied),
failover (requests of a gone worker), recovery (requests waiting for a worker
while none serves), counters (totals and stats).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from itertools import count

from common.types import TokenLogprob, Usage

from services.scheduler.core import gates
from services.scheduler.core.fairness.counters import CoreCounters, core_stats
from services.scheduler.core.faults.drain import DrainOutcome, drain
from services.scheduler.core.faults.failover import Failover, Stranded
from services.scheduler.core.in_flight import dispatch, retire
from services.scheduler.core.fairness.vtc import VirtualTokenCounter
from services.scheduler.core.fairness.quotas import TenantQuotas, TenantUsage
from services.scheduler.core.faults.recovery import Parked, WorkerRecovery
from services.scheduler.core.recent_prefixes import RecentPrefixes
from services.scheduler.core.request_book import RequestBook
from services.scheduler.core.routing import SessionMap, route_with_reason, session_key
from services.scheduler.core.fairness.slot_fairness import preemption_victim
from services.scheduler.core.state import InFlightStep, Phase, RequestState, WorkerState
from services.scheduler.core.step_builder import StepBuilder
from services.scheduler.core.step_planner import StepPlanner
from services.scheduler.core.stopping import take_tokens
from services.scheduler.core.types import (
    CoreConfig, CoreStats, ExpireOutcome, Finish, FinishReason, Gate, Rejection, RequestSpec,
    RequestUpdate, SubmitResult, WorkerSpec,
)
from common.step import PoolStats, SeqResult, StepBatch, StepError, StepOutput

ANONYMOUS_CLIENT = "anonymous"


class SchedulerCore:
    def __init__(self, config: CoreConfig, clock: Callable[[], float],
                 new_id: Callable[[], str]) -> None:
        self._config = config
        self._routing_load_slack = config.routing_load_slack or max(1, config.max_batch_size // 2)
        self._clock = clock
        self._new_id = new_id
        self._workers: dict[str, WorkerState] = {}
        self._vtc = VirtualTokenCounter(config.vtc_input_weight, config.vtc_output_weight)
        self._counts = CoreCounters()
        self._quotas = TenantQuotas(clock)
        self._book = RequestBook(self._vtc, self._counts, self._quotas)
        # The book's maps: the loop reads the first two; the accounting tests
        # check all three are empty once every request has ended.
        self._requests, self._by_seq = self._book.requests, self._book.by_seq
        self._recent = RecentPrefixes(config.prefix_wait_min_tokens, self._waits_unstarted)
        self._waiting_by_client = self._book.waiting
        self._sessions = SessionMap()
        self._failover = Failover(self._book, self._sessions, config.max_active_kv_tokens, config.max_migrations)
        self._recovery = WorkerRecovery(config.worker_recovery_s)
        self._seen_worker = False   # recovery waits for a worker once there has been one
        self._arrivals = count()
        self._step_ids = count(1)
        self._planner = StepPlanner(config, self._vtc, self._book, self._counts, clock, new_id)

    @property
    def config(self) -> CoreConfig:
        return self._config

    # ---- workers ----

    def add_worker(self, spec: WorkerSpec) -> list[RequestUpdate]:
        """Registers a worker. A worker that registers again has restarted: what it
        was running is resumed by recompute (here or on another worker), what
        waited for it keeps waiting."""
        old = self._workers.get(spec.worker_id)
        stranded = self._failover.release(old) if old is not None else Stranded()
        pool = PoolStats(total_blocks=spec.num_blocks, free_blocks=spec.num_blocks,
                            cached_blocks=0, used_blocks=0)
        self._workers[spec.worker_id] = WorkerState(spec=spec, pool=pool, last_heartbeat_s=self._clock())
        self._seen_worker = True
        updates = self._rehome(stranded, f"worker {spec.worker_id} restarted", failed=True)
        return updates + self._take_back_waiting()

    def _take_back_waiting(self) -> list[RequestUpdate]:
        """Places what waited for a worker (recovery.py) once one serves: held requests
        resumed as failover does, parked arrivals submitted as if they came now."""
        if not self._recovery or not any(not w.draining for w in self._workers.values()):
            return []
        stranded, parked = self._recovery.take_all()
        updates = self._failover.rehome(stranded, list(self._workers.values()), "no worker was left")
        for item in parked:
            result = self._place(item.spec, item.cached_prefix_tokens, quota_admitted=True)
            if result.rejection is not None:
                self._quotas.release(item.spec.request_id)
                updates.append(RequestUpdate(item.spec.request_id, rejection=result.rejection))
        return updates

    def _rehome(self, stranded: Stranded, reason: str, failed: bool) -> list[RequestUpdate]:
        """Moves a gone worker's requests to the workers left; with none serving they
        wait for one (WORKER_RECOVERY_S) when recovery is on."""
        serving = any(not w.draining for w in self._workers.values())
        if serving or not self._recovery.enabled:
            return self._failover.rehome(stranded, list(self._workers.values()), reason, failed=failed)
        updates = self._failover.count_failures(stranded, reason) if failed else []
        self._recovery.hold(stranded, reason, self._clock())
        return updates

    def heartbeat(self, worker_id: str) -> bool:
        worker = self._workers.get(worker_id)
        if worker is None:
            return False
        worker.last_heartbeat_s = self._clock()
        return True

    def remove_worker(self, worker_id: str, message: str) -> list[RequestUpdate]:
        """Takes a worker out of the rotation. Its requests move to the workers that
        are left: waiting ones as they were, running ones resumed by recompute from
        the tokens they have streamed so far (their clients see no gap and no
        repeat). With no worker left, running requests end with an error and waiting
        ones are rejected."""
        worker = self._workers.get(worker_id)
        if worker is None:
            return []
        stranded = self._failover.release(worker)
        del self._workers[worker_id]
        return self._rehome(stranded, message, failed=True)

    def drain_worker(self, worker_id: str) -> DrainOutcome:
        """A worker leaving on purpose: routed nothing new, its requests moved (drain.py)."""
        return drain(self._workers, worker_id, self._failover)

    def worker_ids(self) -> list[str]:
        return list(self._workers)

    def has_worker(self, worker_id: str) -> bool:
        return worker_id in self._workers

    def expire(self) -> ExpireOutcome:
        """Drops workers that stopped heartbeating, fails requests that
        waited past the queue timeout without being admitted, and ends those
        past their tenant's max_request_s ("length": what they generated stands)."""
        now = self._clock()
        updates: list[RequestUpdate] = []
        removed: list[str] = []
        for worker in list(self._workers.values()):
            silence = now - worker.last_heartbeat_s
            if silence > self._config.heartbeat_timeout_s:
                removed.append(worker.worker_id)
                updates.extend(self.remove_worker(
                    worker.worker_id,
                    f"worker {worker.worker_id} stopped heartbeating ({silence:.1f} s since the last one)"))
        timeout_s = self._config.queue_timeout_s
        for worker in self._workers.values():
            for request in list(worker.pending):
                waited = now - request.arrival_s
                if gates.timed_out(request.started, waited, timeout_s):
                    message = gates.timeout_message(request.held_by, waited, timeout_s)
                    updates.append(self._book.reject(worker, request, Gate.TIMEOUT, message))
        updates.extend(self._recovery.end_overdue(now, self._book))
        for request_id, limit_s in self._quotas.overdue():
            request = self._requests.get(request_id)
            if request is not None:
                finish = self._finish(request, FinishReason.LENGTH,
                                      f"the tenant's max_request_s of {limit_s:g} s ran out")
                updates.append(RequestUpdate(request_id, finish=finish))
        return ExpireOutcome(updates=tuple(updates), removed_workers=tuple(removed))

    # ---- requests ----

    def submit(self, spec: RequestSpec,
               cached_prefix_tokens: Mapping[str, int] | None = None) -> SubmitResult:
        """Queues a request on a worker, or rejects it at once.

        Args:
            spec: the request (prompt ids, sampling, limits, tenant and quotas); an empty
                request id gets one of the core's.
            cached_prefix_tokens: the kvcache index's answer, worker id -> how many of
                the prompt's leading tokens it holds cached (routing prefers the longest).

        Returns:
            The placement (request id, worker, the updates to stream at once), or the
            rejection (gate, message, retry-after) when a gate refuses it before queueing;
            while no worker is left and WORKER_RECOVERY_S allows, the request is parked.
        """
        if not spec.request_id:
            spec = replace(spec, request_id=self._new_id())
        num_waiting = sum(len(w.pending) for w in self._workers.values()) + len(self._recovery)
        serving = sum(not worker.draining for worker in self._workers.values())
        parking = not self._workers and self._recovery.enabled and self._seen_worker
        known = spec.request_id in self._requests or spec.request_id in self._recovery
        rejection = gates.reject_early(spec, known, serving or parking, num_waiting, self._config.max_queue_len)
        if rejection is not None:
            return self._count_rejection(spec.request_id, rejection)
        if parking:
            return self._park(spec, cached_prefix_tokens or {})
        return self._place(spec, cached_prefix_tokens or {})

    def _park(self, spec: RequestSpec, cached_prefix_tokens: Mapping[str, int]) -> SubmitResult:
        """Queues a request while no worker serves (recovery.py), under its tenant's quota."""
        refusal = self._admit_quota(spec)
        if refusal is not None:
            return self._count_rejection(spec.request_id, refusal)
        self._recovery.park(spec, cached_prefix_tokens, self._clock())
        return SubmitResult(request_id=spec.request_id, worker_id="")

    def _admit_quota(self, spec: RequestSpec) -> Rejection | None:
        refusal = self._quotas.admit(spec.request_id, spec.client_id or ANONYMOUS_CLIENT, spec.quota,
                                     len(spec.prompt_token_ids), spec.resubmitted,
                                     started=bool(spec.resume_token_ids))
        if refusal is None:
            return None
        return Rejection(Gate.QUOTA if refusal.retry_after_s else Gate.NEVER_FIT, refusal.message,
                         refusal.retry_after_s)

    def _place(self, spec: RequestSpec, cached_prefix_tokens: Mapping[str, int],
               quota_admitted: bool = False) -> SubmitResult:
        """Routes a request that passed the early gates to a serving worker and queues it
        there, or rejects it. `quota_admitted`: its tenant's quota holds it already (parked)."""
        worker, reason = route_with_reason(
            spec.prompt_token_ids, session_key(spec), list(self._workers.values()), self._sessions,
            cached_prefix_tokens, self._config.prefix_wait_min_tokens, spec.cache_salt, spec.lora_name,
            self._routing_load_slack, self._recent)
        assert worker is not None   # reject_early: there is a worker
        prompt_len = len(spec.prompt_token_ids)
        limit = gates.tokens_limit(self._config.max_tokens_limit, worker.spec.max_model_len)
        max_tokens = gates.output_limit(spec.max_tokens, prompt_len, worker.spec.max_model_len, limit)
        kv_policy = gates.kv_policy_of(spec, self._config.kv_policy)
        cap = kv_policy.cache_blocks(worker.spec.block_size) * worker.spec.block_size
        problem = gates.never_fit(worker.spec, prompt_len, max_tokens, self._config.max_active_kv_tokens,
                                  generated=len(spec.resume_token_ids), cap_tokens=cap)
        if problem:
            return self._count_rejection(spec.request_id, Rejection(Gate.NEVER_FIT, problem))
        over = gates.over_tokens_limit(max_tokens, limit)   # a lossy policy passes never_fit
        if over is not None:
            return self._count_rejection(spec.request_id, over)
        client_id = spec.client_id or ANONYMOUS_CLIENT
        refusal = None if quota_admitted else self._admit_quota(spec)
        if refusal is not None:
            return self._count_rejection(spec.request_id, refusal)
        if spec.session_id:
            self._sessions.remember(session_key(spec), worker.worker_id)
        request = RequestState.arriving(spec, client_id, max_tokens, self._clock(),
                                        next(self._arrivals), worker.worker_id, kv_policy, cap)
        self._book.add(worker, request)
        self._recent.add(request)
        self._counts.count_route(reason)
        return SubmitResult(request_id=spec.request_id, worker_id=worker.worker_id)

    def _waits_unstarted(self, request: RequestState) -> bool:
        """Whether a request is still the book's and queued or prefilling (recent_prefixes.py)."""
        return self._requests.get(request.request_id) is request and request.phase in (
            Phase.PENDING, Phase.PREFILLING)

    def cancel(self, request_id: str) -> tuple[bool, list[RequestUpdate]]:
        """Ends a request now; its sequence is freed in its worker's next step."""
        request = self._requests.get(request_id)
        if request is None:
            parked = self._recovery.forget(request_id, self._book)
            if not isinstance(parked, Parked):
                return False, []
            self._counts.count_finish(FinishReason.CANCELLED)
            usage = Usage(prompt_tokens=len(parked.spec.prompt_token_ids),
                          completion_tokens=len(parked.spec.resume_token_ids))
            return True, [RequestUpdate(request_id, finish=Finish(reason=FinishReason.CANCELLED, usage=usage))]
        finish = self._finish(request, FinishReason.CANCELLED)
        return True, [RequestUpdate(request_id, finish=finish)]

    def worker_of(self, request_id: str) -> str | None:
        request = self._requests.get(request_id)
        return request.worker_id if request else None

    # ---- steps ----

    def plan_step(self, worker_id: str) -> StepBatch | None:
        """The next step for a worker, or None when it has nothing to do. With a
        step in flight (async scheduling) the plan assumes that step runs as
        planned: its chunks computed, its samples taken.

        Args:
            worker_id: a registered worker with fewer than `max_steps_in_flight` steps
                out.

        Returns:
            The step to send (frees, new sequences, work items within the batch's token
            and block budgets, chosen by the fairness policy), recorded as in flight until
            `apply_step` gets its outcome; None when nothing is runnable.
        """
        worker = self._workers[worker_id]
        if len(worker.in_flight) >= self.step_depth(worker_id):
            raise RuntimeError(f"worker {worker_id} already has {len(worker.in_flight)} step(s) in flight")
        frees, releasing_blocks = worker.take_frees()
        plan = StepBuilder(next(self._step_ids), worker.available_blocks() + releasing_blocks,
                           self._config.max_batch_tokens, frees)
        self._planner.fill(worker, plan)
        worker.last_step_was_prefill = plan.has_prefill and not plan.has_decode
        step = plan.build(worker.in_flight[-1].plan.step_id if worker.in_flight else 0, worker.spec.epoch)
        if step is not None:
            worker.in_flight.append(InFlightStep(step, plan.available_blocks, dispatch(step, self._by_seq),
                                                 decode_only=plan.has_decode and not plan.has_prefill))
        return step

    def step_depth(self, worker_id: str) -> int:
        """How many steps the worker may have in flight now: `max_steps_in_flight`, and one more
        while a step of multi-step decodes is in flight and a request waits that a step could
        admit there, so that its prefill reaches the worker now (the worker ends those decodes at
        their next run when a step bringing new sequences waits behind them) instead of after
        them. Requests queued behind a full batch wait for a slot to free either way."""
        worker = self._workers[worker_id]
        depth = self._config.max_steps_in_flight
        runs_in_flight = any(item.decode_steps > 1 for step in worker.in_flight for item in step.plan.work)
        if runs_in_flight and self._planner.admits_waiting(worker):
            depth += 1
        return depth

    def apply_step(self, worker_id: str, outcome: StepOutput) -> list[RequestUpdate]:
        """Feeds a worker's step results back; returns what the streams get.

        Args:
            worker_id: the worker the step ran on.
            outcome: its results, in step order; an outcome of an earlier registration
                of the worker, or of a step no longer first in flight, is ignored.

        Returns:
            One update per request touched: its new tokens, a finish (reason and usage),
            or an error; requests cancelled or moved while the step ran get none.
        """
        worker = self._workers.get(worker_id)
        if worker is None:
            return []
        if not worker.in_flight or worker.in_flight[0].plan.step_id != outcome.step_id:
            return []  # a step of an earlier registration of this worker
        done, echoes_refusal = worker.settle(outcome)
        retire(done, self._by_seq, worker_id)
        later_tokens = worker.tokens_in_flight()
        updates: list[RequestUpdate] = []
        for result in outcome.results:
            request = self._by_seq.get(result.seq_id)
            if request is None or request.worker_id != worker_id:
                continue  # cancelled, finished or preempted while the step ran
            update = self._apply_result(worker, request, result, later_tokens[result.seq_id], echoes_refusal)
            if update is not None:
                updates.append(update)
        return updates

    # ---- statistics ----

    def drain_queue_waits(self) -> list[float]:
        """Seconds from arrival to first admission, since the last call."""
        return self._counts.drain_queue_waits()

    def tenant_usage(self, tenant: str) -> TenantUsage:
        """A tenant's generations in flight and queued, and its refusals (core/quotas.py)."""
        return self._quotas.usage(tenant)

    def charge_elsewhere(self, charges: Mapping[str, float]) -> None:
        """Clients' service on other scheduler shards (fairness/peer_charges.py), for fairness here."""
        for client_id, normalized in charges.items():
            self._vtc.charge_elsewhere(client_id, normalized)

    def note_peer_quotas(self, peer: str, usages: list[QuotaUsage]) -> None:
        """A peer shard's tenants' holds and spending, counted against their quotas here
        (fairness/peer_quotas.py)."""
        self._quotas.note_peer(peer, usages)

    def forget_peer(self, peer: str) -> None:
        """A peer shard stopped answering: what its tenants held there no longer counts here."""
        self._quotas.forget_peer(peer)

    def stats(self) -> CoreStats:
        return core_stats(self._config.policy, self._counts, self._workers.values(), self._vtc.snapshot(),
                          now=self._clock(), heartbeat_timeout_s=self._config.heartbeat_timeout_s,
                          waiting_for_worker=len(self._recovery), waiting_since_s=self._recovery.oldest_s(),
                          worker_recovery_s=self._config.worker_recovery_s,
                          quotas=tuple(self._quotas.report()))

    def _count_rejection(self, request_id: str, rejection: Rejection) -> SubmitResult:
        self._counts.count_rejection(rejection.gate)
        return SubmitResult(request_id=request_id, rejection=rejection)

    # ---- results ----

    def _apply_result(self, worker: WorkerState, request: RequestState, result: SeqResult,
                      later_tokens: int, echoes_refusal: bool) -> RequestUpdate | None:
        # What the worker holds now, plus what the steps still in flight add (`later_tokens`),
        # capped at what it will hold (a prefix-cache hit may compute more than was planned).
        tokens = (result.token_id, *result.more_token_ids) if result.sampled and not result.error else ()
        holds = request.worker_tokens + len(tokens)
        request.num_computed = min(result.num_computed_tokens + later_tokens, holds)
        if result.error == StepError.OUT_OF_BLOCKS:
            # Nothing changed on the worker; make room for the next step. Refusals of steps
            # already in flight echo this one: they make no more room and do not lift it.
            if not echoes_refusal:
                worker.note_refusal()
                self._book.preempt(worker, preemption_victim(worker.running))
            return None
        if result.error:
            finish = self._finish(request, FinishReason.ERROR,
                                  f"worker {worker.worker_id} failed the sequence: {result.error}")
            return RequestUpdate(request.request_id, finish=finish)
        if request.cached_tokens is None:
            request.cached_tokens = min(result.num_cached_tokens, len(request.prompt))
        request.note_prompt_logprobs(result.prompt_logprobs_start, result.prompt_logprobs)
        if not tokens:
            return None
        self._book.activate(worker, request)
        return self._stream(worker, request, tokens, (result.logprob, *result.more_logprobs))

    def _stream(self, worker: WorkerState, request: RequestState, tokens: tuple[int, ...],
                logprobs: tuple[TokenLogprob | None, ...]) -> RequestUpdate:
        out, out_logprobs, reason = take_tokens(request, tokens, logprobs, worker.spec.eos_token_ids)
        self._vtc.charge_output(request.client_id, len(out), user=request.user)
        self._quotas.produced(request.request_id, len(out))
        finish = self._finish(request, reason) if reason is not None else None
        return RequestUpdate(request.request_id, tokens=out, logprobs=out_logprobs, finish=finish,
                             prompt_logprobs=request.take_prompt_logprobs())

    def _finish(self, request: RequestState, reason: FinishReason, message: str = "") -> Finish:
        if request.request_id in self._recovery:      # waiting for a worker: on none's lists
            self._recovery.forget(request.request_id, self._book)
        return self._book.finish(self._workers.get(request.worker_id), request, reason, message)
