"""The scheduling core: queues, admission, step planning and bookkeeping for
every worker. Pure and synchronous; the transport calls it from one event
loop, feeds it step outcomes and delivers the request updates it returns.

Life of a request: submit() puts it in its worker's pending queue (or
rejects it). plan_step() admits pending requests under the gates, sends
their prompts in chunks (prefilling), then one decode per step (active).
apply_step() turns the worker's results into token events and finishes.
A sequence that loses its blocks to a preemption goes back to pending with
its generated tokens and is later recomputed from prompt + output.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import replace
from itertools import count

from common.sequence_ids import sequence_id
from common.types import SamplingParams, Usage

from services.scheduler.core.policy import VirtualTokenCounter, pick_next
from services.scheduler.core.prefix_share import blocked_by_leaders, shared_prefix_tokens
from services.scheduler.core.routing import SessionMap, choose_worker
from services.scheduler.core.state import InFlightStep, Phase, RequestState, WorkerState, blocks_for
from services.scheduler.core.types import (
    OUT_OF_BLOCKS, CoreConfig, CoreStats, ExpireOutcome, Finish, FinishReason, Gate,
    NewSequence, Policy, PoolSnapshot, PrefillMode, Rejection, RequestSpec, RequestUpdate, SeqResult,
    StepOutcome, StepPlan, SubmitResult, TokenOut, WorkerSpec, WorkerSummary, WorkItem,
)

ANONYMOUS_CLIENT = "anonymous"
MAX_TRACKED_CLIENTS = 10000


def worker_sampling(request: RequestState) -> SamplingParams:
    """The request's sampling settings plus what the worker must ban until
    min_tokens: a stop token sampled early would be generated and then ignored."""
    spec = request.spec
    if spec.min_tokens <= 0:
        return spec.sampling
    return replace(spec.sampling, min_tokens=spec.min_tokens,
                   stop_token_ids=tuple(sorted(spec.stop_token_ids)))


class _PlanBuilder:
    """One step under construction, with what is left of its budgets."""

    def __init__(self, step_id: int, available_blocks: int, token_budget: int,
                 frees: list[str]) -> None:
        self.step_id = step_id
        self.available_blocks = available_blocks
        self.token_budget = token_budget
        self.frees = frees
        self.new_sequences: list[NewSequence] = []
        # seq_id -> tokens, blocks, is_decode, draft tokens (which count against the token budget)
        self._work: dict[str, tuple[int, int, bool, int]] = {}

    def add(self, seq_id: str, tokens: int, blocks: int, is_decode: bool, drafts: int = 0) -> None:
        self._work[seq_id] = (tokens, blocks, is_decode, drafts)
        self.token_budget -= tokens + drafts
        self.available_blocks -= blocks

    def drop(self, seq_id: str) -> None:
        tokens, blocks, _, drafts = self._work.pop(seq_id, (0, 0, False, 0))
        self.token_budget += tokens + drafts
        self.available_blocks += blocks

    @property
    def has_work(self) -> bool:
        return bool(self._work)

    @property
    def has_prefill(self) -> bool:
        return any(not is_decode for _, _, is_decode, _ in self._work.values())

    @property
    def has_decode(self) -> bool:
        return any(is_decode for _, _, is_decode, _ in self._work.values())

    def build(self, after_step_id: int = 0) -> StepPlan | None:
        if not (self._work or self.frees or self.new_sequences):
            return None
        return StepPlan(
            step_id=self.step_id, new_sequences=tuple(self.new_sequences),
            work=tuple(WorkItem(seq_id, tokens, drafts) for seq_id, (tokens, _, _, drafts) in self._work.items()),
            free_seq_ids=tuple(self.frees), after_step_id=after_step_id,
        )


class SchedulerCore:
    def __init__(self, config: CoreConfig, clock: Callable[[], float],
                 new_id: Callable[[], str]) -> None:
        self._config = config
        self._clock = clock
        self._new_id = new_id
        self._workers: dict[str, WorkerState] = {}
        self._requests: dict[str, RequestState] = {}
        self._by_seq: dict[str, RequestState] = {}
        self._vtc = VirtualTokenCounter(config.vtc_input_weight, config.vtc_output_weight)
        self._waiting_by_client: Counter[str] = Counter()
        self._sessions = SessionMap()
        self._arrivals = count()
        self._step_ids = count(1)
        self._admitted = 0
        self._preemptions = 0
        self._migrations = 0
        self._finished: Counter[str] = Counter()
        self._rejections: Counter[str] = Counter()
        self._holds: Counter[str] = Counter()
        self._queue_waits: list[float] = []

    @property
    def config(self) -> CoreConfig:
        return self._config

    # ---- workers ----

    def add_worker(self, spec: WorkerSpec) -> list[RequestUpdate]:
        """Registers a worker. A worker that registers again has restarted: what it
        was running is resumed by recompute (here or on another worker), what
        waited for it keeps waiting."""
        stranded: tuple[list[RequestState], list[RequestState]] = ([], [])
        old = self._workers.get(spec.worker_id)
        if old is not None:
            stranded = self._release_worker(old)
        pool = PoolSnapshot(total_blocks=spec.num_blocks, free_blocks=spec.num_blocks,
                            cached_blocks=0, used_blocks=0)
        self._workers[spec.worker_id] = WorkerState(spec=spec, pool=pool, last_heartbeat_s=self._clock())
        return self._rehome(*stranded, f"worker {spec.worker_id} restarted")

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
        stranded = self._release_worker(worker)
        del self._workers[worker_id]
        return self._rehome(*stranded, message)

    def worker_ids(self) -> list[str]:
        return list(self._workers)

    def has_worker(self, worker_id: str) -> bool:
        return worker_id in self._workers

    def expire(self) -> ExpireOutcome:
        """Drops workers that stopped heartbeating and fails requests that
        waited past the queue timeout without being admitted."""
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
        for worker in self._workers.values():
            for request in list(worker.pending):
                waited = now - request.arrival_s
                if not request.admitted_once and waited > self._config.queue_timeout_s:
                    updates.append(self._reject_waiting(worker, request, Gate.TIMEOUT,
                                                        self._timeout_message(request, waited)))
        return ExpireOutcome(updates=tuple(updates), removed_workers=tuple(removed))

    # ---- requests ----

    def submit(self, spec: RequestSpec,
               cached_prefix_tokens: Mapping[str, int] | None = None) -> SubmitResult:
        """Queues a request on a worker, or rejects it at once."""
        if not spec.request_id:
            spec = replace(spec, request_id=self._new_id())
        rejection = self._reject_early(spec)
        if rejection is not None:
            return self._count_rejection(spec.request_id, rejection)
        session_worker = self._sessions.get(spec.session_id) if spec.session_id else None
        hints = self._with_inflight_prefixes(spec.prompt_token_ids, cached_prefix_tokens or {})
        worker = choose_worker(list(self._workers.values()), session_worker, hints)
        assert worker is not None
        prompt_len = len(spec.prompt_token_ids)
        max_tokens = spec.max_tokens if spec.max_tokens > 0 else worker.spec.max_model_len - prompt_len
        problem = self._never_fit(worker.spec, prompt_len, max_tokens)
        if problem:
            return self._count_rejection(spec.request_id, Rejection(Gate.NEVER_FIT, problem))
        if spec.session_id:
            self._sessions.remember(spec.session_id, worker.worker_id)
        client_id = spec.client_id or ANONYMOUS_CLIENT
        request = RequestState(spec=spec, client_id=client_id, max_tokens=max_tokens,
                               arrival_s=self._clock(), arrival_order=next(self._arrivals),
                               worker_id=worker.worker_id)
        if self._waiting_by_client[client_id] == 0:
            self._vtc.lift_on_arrival(client_id, list(self._waiting_by_client))
        self._requests[spec.request_id] = request
        self._enqueue(worker, request)
        return SubmitResult(request_id=spec.request_id, worker_id=worker.worker_id)

    def cancel(self, request_id: str) -> tuple[bool, list[RequestUpdate]]:
        """Ends a request now; its sequence is freed in its worker's next step."""
        request = self._requests.get(request_id)
        if request is None:
            return False, []
        finish = self._finish(request, FinishReason.CANCELLED)
        return True, [RequestUpdate(request_id, finish=finish)]

    def worker_of(self, request_id: str) -> str | None:
        request = self._requests.get(request_id)
        return request.worker_id if request else None

    # ---- steps ----

    def plan_step(self, worker_id: str) -> StepPlan | None:
        """The next step for a worker, or None when it has nothing to do. With a
        step in flight (async scheduling) the plan assumes that step runs as
        planned: its chunks computed, its samples taken."""
        worker = self._workers[worker_id]
        if len(worker.in_flight) >= self._config.max_steps_in_flight:
            raise RuntimeError(f"worker {worker_id} already has {len(worker.in_flight)} step(s) in flight")
        plan = _PlanBuilder(next(self._step_ids), worker.available_blocks() + worker.releasing_blocks,
                            self._config.max_batch_tokens, worker.frees)
        worker.frees, worker.releasing_blocks = [], 0
        prefill_turn = self._prefill_turn(worker)
        if prefill_turn is None:
            self._plan_decodes(worker, plan)
            self._plan_prefill(worker, plan)
        elif prefill_turn:
            self._plan_prefill(worker, plan)
            if not plan.has_work:
                self._plan_decodes(worker, plan)
        else:
            self._plan_decodes(worker, plan)
        worker.last_step_was_prefill = plan.has_prefill and not plan.has_decode
        step = plan.build(after_step_id=worker.in_flight[-1].plan.step_id if worker.in_flight else 0)
        if step is not None:
            worker.in_flight.append(InFlightStep(step, plan.available_blocks, self._dispatch(step)))
        return step

    def apply_step(self, worker_id: str, outcome: StepOutcome) -> list[RequestUpdate]:
        """Feeds a worker's step results back; returns what the streams get."""
        worker = self._workers.get(worker_id)
        if worker is None:
            return []
        if not worker.in_flight or worker.in_flight[0].plan.step_id != outcome.step_id:
            return []  # a step of an earlier registration of this worker
        done = worker.in_flight.pop(0)
        # A step planned before the last refusal was known repeats it; one planned
        # after it that ran lifts it.
        echoes_refusal = worker.refused_allocation and done.plan.step_id <= worker.refusal_seen_by_step
        if not echoes_refusal:
            worker.refused_allocation = False
        # Later plans started from this one's estimate of the pool: correct them.
        surprise = outcome.pool.available_blocks - done.available_after
        worker.in_flight = [replace(step, available_after=step.available_after + surprise)
                            for step in worker.in_flight]
        worker.pool = outcome.pool
        worker.steps += 1
        worker.last_step_ms = outcome.forward_ms
        worker.last_batch_size = len(done.plan.work)
        for seq_id in done.sampling:
            request = self._by_seq.get(seq_id)
            if request is not None and request.worker_id == worker_id:
                request.inflight_samples -= 1
        for item in done.plan.work:
            request = self._by_seq.get(item.seq_id)
            if item.draft_tokens and request is not None and request.worker_id == worker_id:
                request.inflight_drafts -= item.draft_tokens
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

    def _dispatch(self, step: StepPlan) -> frozenset[str]:
        """Counts a planned step's work as done; returns the sequences it should sample."""
        sampling = set()
        for item in step.work:
            request = self._by_seq[item.seq_id]
            request.num_computed += item.max_tokens
            request.inflight_drafts += item.draft_tokens
            if request.num_computed >= request.worker_tokens:
                request.inflight_samples += 1
                sampling.add(item.seq_id)
        return frozenset(sampling)

    # ---- statistics ----

    def drain_queue_waits(self) -> list[float]:
        """Seconds from arrival to first admission, since the last call."""
        waits, self._queue_waits = self._queue_waits, []
        return waits

    def stats(self) -> CoreStats:
        workers = tuple(
            WorkerSummary(
                worker_id=w.worker_id, address=w.spec.address,
                healthy=self._clock() - w.last_heartbeat_s <= self._config.heartbeat_timeout_s,
                running=len(w.running), pending=len(w.pending), free_blocks=w.pool.free_blocks,
                cached_blocks=w.pool.cached_blocks, total_blocks=w.pool.total_blocks,
                used_blocks=w.pool.used_blocks, evictions=w.pool.evictions,
                last_step_ms=w.last_step_ms, last_batch_size=w.last_batch_size, steps=w.steps,
                reserved_kv_tokens=w.reserved_kv_tokens)
            for w in self._workers.values())
        return CoreStats(
            policy=self._config.policy,
            pending=sum(len(w.pending) for w in self._workers.values()),
            prefilling=sum(len(w.prefilling) for w in self._workers.values()),
            active=sum(len(w.active) for w in self._workers.values()),
            admitted=self._admitted, finished=sum(self._finished.values()),
            preemptions=self._preemptions, migrations=self._migrations, rejections=dict(self._rejections),
            holds=dict(self._holds), workers=workers, clients=self._vtc.snapshot(),
            reserved_kv_tokens=sum(w.reserved_kv_tokens for w in self._workers.values()),
            finished_by_reason=dict(self._finished),
        )

    # ---- admission checks ----

    def _reject_early(self, spec: RequestSpec) -> Rejection | None:
        if not spec.prompt_token_ids:
            return Rejection(Gate.INVALID, "the prompt is empty")
        if spec.request_id in self._requests:
            return Rejection(Gate.INVALID, f"request_id {spec.request_id!r} is already in flight")
        if not self._workers:
            return Rejection(Gate.NO_WORKER, "no worker is registered")
        waiting = sum(len(w.pending) for w in self._workers.values())
        if waiting >= self._config.max_queue_len:
            return Rejection(Gate.QUEUE, f"the queue is full: {waiting} requests waiting "
                                         f"(MAX_QUEUE_LEN={self._config.max_queue_len})")
        return None

    def _never_fit(self, worker: WorkerSpec, prompt_len: int, max_tokens: int) -> str:
        total = prompt_len + max_tokens
        head = f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) = {total} tokens"
        if max_tokens <= 0 or total > worker.max_model_len:
            return f"{head} exceeds the model context of {worker.max_model_len} tokens"
        blocks = blocks_for(total, worker.block_size)
        if blocks > worker.num_blocks:
            return (f"{head} needs {blocks} KV blocks of {worker.block_size} tokens, "
                    f"but the worker's pool has {worker.num_blocks}")
        if total > self._config.max_active_kv_tokens:
            return f"{head} exceeds MAX_ACTIVE_KV_TOKENS={self._config.max_active_kv_tokens}"
        return ""

    def _count_rejection(self, request_id: str, rejection: Rejection) -> SubmitResult:
        self._rejections[rejection.gate.value] += 1
        return SubmitResult(request_id=request_id, rejection=rejection)

    def _hold(self, request: RequestState, gate: Gate) -> None:
        if gate not in request.held_by:
            request.held_by.add(gate)
            self._holds[gate.value] += 1

    def _timeout_message(self, request: RequestState, waited: float) -> str:
        held = ", ".join(sorted(g.value for g in request.held_by)) or "queue order"
        return (f"not admitted after {waited:.1f} s (QUEUE_TIMEOUT_S={self._config.queue_timeout_s:g}); "
                f"held by: {held}")

    # ---- planning ----

    def _prefill_turn(self, worker: WorkerState) -> bool | None:
        """None: prefill and decodes share the step. Otherwise whether this
        step of the alternating mode is the prefill one."""
        if self._config.prefill_mode is PrefillMode.MIXED:
            return None
        if not worker.active or not (worker.prefilling or worker.pending):
            return None
        return not worker.last_step_was_prefill

    def _plan_decodes(self, worker: WorkerState, plan: _PlanBuilder) -> None:
        block_size = worker.spec.block_size
        config = self._config
        speculating = config.speculative_tokens > 0 and (
            config.speculative_max_batch <= 0 or len(worker.active) <= config.speculative_max_batch)
        for request in sorted(worker.active, key=lambda r: r.running_key):
            if request.phase is not Phase.ACTIVE or request.worker_id != worker.worker_id:
                continue  # preempted while this step was being planned
            if request.outputs_if_drafts_kept >= request.max_tokens:
                continue  # its last tokens are (or, as drafts, may be) sampled in a step in flight
            if plan.token_budget < 1:
                return
            needed = blocks_for(request.num_computed + 1, block_size) - worker.blocks_held(request)
            if self._make_room(worker, plan, request, needed):
                assert request.seq_id is not None
                drafts, extra = self._draft_allowance(worker, plan, request, needed) if speculating else (0, 0)
                plan.add(request.seq_id, 1, needed + extra, is_decode=True, drafts=drafts)

    def _draft_allowance(self, worker: WorkerState, plan: _PlanBuilder, request: RequestState,
                         needed: int) -> tuple[int, int]:
        """(speculative tokens, extra blocks for their slots) a decode may verify: within
        max_tokens even if every draft in flight is kept, the step's token budget, and
        the blocks left without evicting anything for it."""
        block_size = worker.spec.block_size
        left = request.max_tokens - request.outputs_if_drafts_kept - 1
        drafts = min(self._config.speculative_tokens, left, plan.token_budget - 1)
        held = worker.blocks_held(request) + needed
        capacity = (held + max(plan.available_blocks - needed, 0)) * block_size - (request.num_computed + 1)
        drafts = min(drafts, capacity)
        if drafts <= 0:
            return 0, 0
        return drafts, blocks_for(request.num_computed + 1 + drafts, block_size) - held

    def _plan_prefill(self, worker: WorkerState, plan: _PlanBuilder) -> None:
        for request in sorted(worker.prefilling, key=lambda r: r.running_key):
            if request.phase is not Phase.PREFILLING:
                continue
            if plan.token_budget < 1:
                return
            self._plan_chunk(worker, plan, request)
        self._plan_admissions(worker, plan)

    def _plan_chunk(self, worker: WorkerState, plan: _PlanBuilder, request: RequestState) -> None:
        # Once its last chunk is in flight, the next "chunk" is its first decode.
        wanted = min(request.worker_tokens - request.num_computed,
                     self._config.prefill_chunk_size, plan.token_budget)
        if wanted <= 0 or not request.wants_more:
            return
        tokens = self._tokens_that_fit(worker, plan, request, wanted)
        if tokens == 0:
            one_more = blocks_for(request.num_computed + 1, worker.spec.block_size) - worker.blocks_held(request)
            if not self._make_room(worker, plan, request, one_more):
                return
            tokens = self._tokens_that_fit(worker, plan, request, wanted)
        needed = blocks_for(request.num_computed + tokens, worker.spec.block_size) - worker.blocks_held(request)
        assert request.seq_id is not None
        plan.add(request.seq_id, tokens, needed, is_decode=False)

    @staticmethod
    def _tokens_that_fit(worker: WorkerState, plan: _PlanBuilder, request: RequestState,
                         wanted: int) -> int:
        capacity = ((worker.blocks_held(request) + max(plan.available_blocks, 0)) * worker.spec.block_size
                    - request.num_computed)
        return max(0, min(wanted, capacity))

    def _plan_admissions(self, worker: WorkerState, plan: _PlanBuilder) -> None:
        config = self._config
        if worker.refused_allocation:
            return
        block_size, min_shared = worker.spec.block_size, config.prefix_wait_min_tokens
        blocked = blocked_by_leaders(worker.pending, worker.prefilling, block_size, min_shared)
        while worker.pending and plan.token_budget >= 1:
            candidates = [r for r in worker.pending if r.request_id not in blocked] if blocked else worker.pending
            request = pick_next(candidates, config.policy, self._vtc)
            if request is None:
                return
            if len(worker.running) >= config.max_batch_size:
                victim = self._slot_victim(worker, plan, request)
                if victim is None:
                    return
                self._preempt(worker, victim, plan)
            if worker.reserved_kv_tokens + request.kv_reservation > config.max_active_kv_tokens:
                self._hold(request, Gate.ACTIVE_KV)
                return
            if blocks_for(request.known_tokens, worker.spec.block_size) > plan.available_blocks:
                self._hold(request, Gate.CACHE_POOL)
                return
            self._admit(worker, plan, request)
            blocked |= blocked_by_leaders(worker.pending, [request], block_size, min_shared)

    def _with_inflight_prefixes(self, prompt: tuple[int, ...],
                                cached_prefix_tokens: Mapping[str, int]) -> dict[str, int]:
        """The index's cached-prefix hints, raised where a worker is about to hold a
        longer prefix: one of its queued or prefilling requests shares it."""
        hints = dict(cached_prefix_tokens)
        min_tokens = self._config.prefix_wait_min_tokens
        if min_tokens <= 0 or len(self._workers) < 2:     # nothing to choose between
            return hints
        for worker in self._workers.values():
            shared = shared_prefix_tokens(prompt, [*worker.pending, *worker.prefilling], min_tokens)
            if shared > hints.get(worker.worker_id, 0):
                hints[worker.worker_id] = shared
        return hints

    def _slot_victim(self, worker: WorkerState, plan: _PlanBuilder,
                     candidate: RequestState) -> RequestState | None:
        """The running request that gives its batch slot to `candidate` when
        the batch is full, if any. A lower-priority request always yields.
        Under vtc, a client holding more than its fair share of slots
        (max_batch_size over the clients with work on this worker) yields
        its latest arrival to a client holding less; the victim keeps its
        tokens and its cached blocks make the recompute cheap. Both rules
        only ever move slots towards higher priority or a fairer split, so
        they cannot ping-pong."""
        admitted_now = {s.seq_id for s in plan.new_sequences}
        movable = [r for r in worker.running if r.seq_id not in admitted_now]
        lower = [r for r in movable if r.priority < candidate.priority]
        if lower:
            return max(lower, key=lambda r: r.running_key)
        if self._config.policy is not Policy.VTC:
            return None
        slots = Counter(r.client_id for r in worker.running)
        clients = set(slots) | {r.client_id for r in worker.pending}
        fair_share = self._config.max_batch_size / len(clients)
        if slots[candidate.client_id] + 1 > fair_share:
            return None
        over_share = [r for r in movable if r.priority == candidate.priority
                      and slots[r.client_id] - 1 >= fair_share
                      and r.client_id != candidate.client_id]
        if not over_share:
            return None
        return max(over_share, key=lambda r: (slots[r.client_id], r.arrival_order))

    def _admit(self, worker: WorkerState, plan: _PlanBuilder, request: RequestState) -> None:
        if not request.admitted_once:
            request.admitted_once = True
            self._admitted += 1
            request.queue_wait_s = self._clock() - request.arrival_s
            self._queue_waits.append(request.queue_wait_s)
            self._vtc.charge_prompt(request.client_id, len(request.prompt))
        self._dequeue(worker, request)
        seq_id = sequence_id(request.request_id, self._new_id())
        request.seq_id, request.num_computed, request.phase = seq_id, 0, Phase.PREFILLING
        worker.prefilling.append(request)
        worker.reserved_kv_tokens += request.kv_reservation
        self._by_seq[seq_id] = request
        plan.new_sequences.append(NewSequence(seq_id=seq_id, prompt_token_ids=request.prompt,
                                              output_token_ids=tuple(request.output),
                                              sampling=worker_sampling(request)))
        tokens = min(request.known_tokens, self._config.prefill_chunk_size, plan.token_budget)
        plan.add(seq_id, tokens, blocks_for(tokens, worker.spec.block_size), is_decode=False)

    def _make_room(self, worker: WorkerState, plan: _PlanBuilder, requester: RequestState,
                   needed_blocks: int) -> bool:
        """Preempts until `needed_blocks` are available; False when the
        requester itself had to go."""
        while plan.available_blocks < needed_blocks:
            victim = max(worker.running, key=lambda r: r.running_key)
            self._preempt(worker, victim, plan)
            if victim is requester:
                return False
        return True

    # ---- results ----

    def _apply_result(self, worker: WorkerState, request: RequestState, result: SeqResult,
                      later_tokens: int, echoes_refusal: bool) -> RequestUpdate | None:
        # What the worker holds now, plus what the steps still in flight add
        # (`later_tokens`); they never compute past the tokens the worker will hold
        # (the cap matters when a prefix-cache hit computed more than was planned).
        tokens = (result.token_id, *result.more_token_ids) if result.sampled and not result.error else ()
        holds = request.worker_tokens + len(tokens)
        request.num_computed = min(result.num_computed_tokens + later_tokens, holds)
        if result.error == OUT_OF_BLOCKS:
            # Nothing changed on the worker; make room for the next step. Steps
            # already in flight were planned without knowing: their refusals are
            # echoes of this one and make no more room, and they do not lift it.
            if echoes_refusal:
                return None
            worker.refused_allocation = True
            worker.refusal_seen_by_step = worker.in_flight[-1].plan.step_id if worker.in_flight else 0
            self._preempt(worker, max(worker.running, key=lambda r: r.running_key))
            return None
        if result.error:
            finish = self._finish(request, FinishReason.ERROR,
                                  f"worker {worker.worker_id} failed the sequence: {result.error}")
            return RequestUpdate(request.request_id, finish=finish)
        if request.cached_tokens is None:
            request.cached_tokens = min(result.num_cached_tokens, len(request.prompt))
        if not tokens:
            return None
        if request.phase is Phase.PREFILLING:
            worker.prefilling.remove(request)
            worker.active.append(request)
            request.phase = Phase.ACTIVE
        logprobs = (result.logprob, *result.more_logprobs)
        out: list[TokenOut] = []
        finish = None
        for index, token_id in enumerate(tokens):
            request.output.append(token_id)
            self._vtc.charge_output(request.client_id)
            out.append(TokenOut(token_id=token_id, logprob=logprobs[index] if index < len(logprobs) else None))
            reason = self._finish_reason(worker, request, token_id)
            if reason is not None:
                # Speculative tokens past a stop or max_tokens are dropped.
                finish = self._finish(request, reason)
                break
        return RequestUpdate(request.request_id, tokens=tuple(out), finish=finish)

    @staticmethod
    def _finish_reason(worker: WorkerState, request: RequestState, token_id: int) -> FinishReason | None:
        spec = request.spec
        generated = len(request.output)
        if generated >= spec.min_tokens:
            if not spec.ignore_eos and token_id in worker.spec.eos_token_ids:
                return FinishReason.STOP
            if token_id in spec.stop_token_ids:
                return FinishReason.STOP
        if generated >= request.max_tokens:
            return FinishReason.LENGTH
        return None

    # ---- moving requests between queues ----

    def _enqueue(self, worker: WorkerState, request: RequestState) -> None:
        request.phase = Phase.PENDING
        worker.pending.append(request)
        self._waiting_by_client[request.client_id] += 1

    def _dequeue(self, worker: WorkerState, request: RequestState) -> None:
        worker.pending.remove(request)
        self._left_queue(request.client_id)

    def _left_queue(self, client_id: str) -> None:
        self._waiting_by_client[client_id] -= 1
        if self._waiting_by_client[client_id] <= 0:
            del self._waiting_by_client[client_id]
            self._vtc.note_departure(client_id)

    def _detach(self, worker: WorkerState, request: RequestState,
                plan: _PlanBuilder | None = None) -> None:
        """Takes a request out of its worker's queues and frees its sequence
        (in `plan` when one is being built, else in the next step)."""
        if request.phase is Phase.PENDING:
            self._dequeue(worker, request)
            return
        (worker.prefilling if request.phase is Phase.PREFILLING else worker.active).remove(request)
        worker.reserved_kv_tokens -= request.kv_reservation
        if request.seq_id is not None:
            seq_id, blocks = request.seq_id, worker.blocks_held(request)
            del self._by_seq[seq_id]
            if plan is not None:
                plan.drop(seq_id)
                plan.frees.append(seq_id)
                plan.available_blocks += blocks
            else:
                worker.frees.append(seq_id)
                worker.releasing_blocks += blocks
        request.seq_id, request.num_computed, request.inflight_samples = None, 0, 0
        request.inflight_drafts = 0

    def _preempt(self, worker: WorkerState, request: RequestState,
                 plan: _PlanBuilder | None = None) -> None:
        self._detach(worker, request, plan)
        request.resumed = True
        self._enqueue(worker, request)
        self._preemptions += 1

    def _finish(self, request: RequestState, reason: FinishReason, message: str = "") -> Finish:
        worker = self._workers.get(request.worker_id)
        if worker is not None:
            self._detach(worker, request)
        self._requests.pop(request.request_id, None)
        self._finished[reason.value] += 1
        self._forget_idle_clients()
        usage = Usage(prompt_tokens=len(request.prompt), completion_tokens=len(request.output),
                      cached_tokens=request.cached_tokens or 0)
        return Finish(reason=reason, usage=usage, message=message, queue_wait_s=request.queue_wait_s)

    def _reject_waiting(self, worker: WorkerState, request: RequestState, gate: Gate,
                        message: str) -> RequestUpdate:
        self._dequeue(worker, request)
        self._requests.pop(request.request_id, None)
        self._rejections[gate.value] += 1
        return RequestUpdate(request.request_id, rejection=Rejection(gate, message))

    def _release_worker(self, worker: WorkerState) -> tuple[list[RequestState], list[RequestState]]:
        """Empties a worker that is gone: (requests that never ran, still counted as
        waiting; requests that ran there, to resume elsewhere: the running ones,
        detached, and preempted ones that were waiting, still counted as waiting)."""
        fresh = [r for r in worker.pending if not r.admitted_once]
        resumable = [r for r in worker.pending if r.admitted_once]
        worker.pending = []
        running = worker.running
        for request in running:
            self._detach(worker, request)
            request.resumed = True
        worker.frees, worker.releasing_blocks = [], 0
        self._sessions.forget_worker(worker.worker_id)
        return fresh, resumable + running

    def _rehome(self, fresh: list[RequestState], resumable: list[RequestState],
                reason: str) -> list[RequestUpdate]:
        updates: list[RequestUpdate] = []
        for request in resumable:
            updates.extend(self._migrate(request, reason))
        for request in fresh:
            updates.extend(self._reroute(request))
        return updates

    def _migrate(self, request: RequestState, reason: str) -> list[RequestUpdate]:
        """Queues a request that ran on a worker that is gone on another worker, to be
        resumed from its prompt and the tokens it has produced."""
        waiting = request.phase is Phase.PENDING     # preempted before: still counted as waiting
        target = choose_worker(list(self._workers.values()), None, {})
        problem = "no worker is left to resume it" if target is None else self._never_fit(
            target.spec, len(request.prompt), request.max_tokens)
        if problem:
            if waiting:
                self._left_queue(request.client_id)
            request.worker_id = ""
            finish = self._finish(request, FinishReason.ERROR, f"{reason}; {problem}")
            return [RequestUpdate(request.request_id, finish=finish)]
        assert target is not None
        self._move_to(target, request, counted_as_waiting=waiting)
        self._migrations += 1
        return []

    def _reroute(self, request: RequestState) -> list[RequestUpdate]:
        """Moves a request that was only waiting (already out of its old
        worker's queue, still counted as waiting) to another worker."""
        target = choose_worker(list(self._workers.values()), None, {})
        if target is None:
            self._left_queue(request.client_id)
            self._requests.pop(request.request_id, None)
            self._rejections[Gate.NO_WORKER.value] += 1
            rejection = Rejection(Gate.NO_WORKER, "no worker is left to serve the request")
            return [RequestUpdate(request.request_id, rejection=rejection)]
        self._move_to(target, request, counted_as_waiting=True)
        return []

    def _move_to(self, target: WorkerState, request: RequestState, counted_as_waiting: bool) -> None:
        """Queues `request` on `target`; its session follows it."""
        request.worker_id = target.worker_id
        if request.spec.session_id:
            self._sessions.remember(request.spec.session_id, target.worker_id)
        if counted_as_waiting:
            target.pending.append(request)
        else:
            self._enqueue(target, request)

    def _forget_idle_clients(self) -> None:
        if len(self._vtc) <= MAX_TRACKED_CLIENTS:
            return
        busy = {r.client_id for r in self._requests.values()}
        idle = [c.client_id for c in self._vtc.snapshot() if c.client_id not in busy]
        self._vtc.forget(idle[: len(self._vtc) - MAX_TRACKED_CLIENTS // 2])
