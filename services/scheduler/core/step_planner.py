"""What goes into one worker's step: decodes of the active requests (with their
draft allowance), the next chunks of the prefilling ones, then admissions from
pending under the gates, preempting where a slot or blocks must be freed. Pure
and synchronous; SchedulerCore.plan_step calls fill() with a fresh StepBuilder
and records the step it builds.

Order within a step (PREFILL_MODE=mixed, the default):

    decodes (oldest first) -> prefill chunks (oldest first) -> admissions (policy order)

In the alternating mode a step is either the decodes or the prefill work, taking
turns while both wait; a prefill turn with nothing to send falls back to decodes.
A decode may verify drafts (allowances/speculation.py) and, while no request waits on the
worker that the step could take, run several times in the step (allowances/decode_steps.py).
"""

from __future__ import annotations

from collections.abc import Callable

from common.sequence_ids import sequence_id

from services.scheduler.core import gates
from services.scheduler.core.fairness.counters import CoreCounters
from services.scheduler.core.fairness.vtc import VirtualTokenCounter
from services.scheduler.core.fairness.policy import effective_policy, pick_next
from services.scheduler.core.prefix_share import blocked_by_leaders
from services.scheduler.core.request_book import RequestBook
from services.scheduler.core.room import blocks_to_grow, tokens_that_fit, victims_for_room
from services.scheduler.core.fairness.slot_fairness import slot_victim
from services.scheduler.core.allowances.decode_steps import (multi_stepping, quick_runs, runs_allowance,
                                                             runs_until_slots_free)
from services.scheduler.core.allowances.speculation import draft_allowance, drafts_allowed, speculating
from services.scheduler.core.state import Phase, RequestState, WorkerState, blocks_for
from services.scheduler.core.step_builder import StepBuilder
from services.scheduler.core.types import CoreConfig, Policy, PrefillMode


def one_token_chunk_in_flight(request: RequestState, worker: WorkerState) -> bool:
    """Whether the request waits for its first chunk's reply before its next chunk is planned:
    it has one token left to sample and that chunk, in flight, may bring it. The worker serves
    a chunk past its end from its prefix cache (an identical or mostly cached prompt), sampling
    at the prompt's end; a next chunk planned meanwhile would then be a decode whose token
    max_tokens throws away: a whole wasted step at one stream, which every request arriving
    behind it waits out. Requests with more tokens to come keep their chunks pipelined (that
    next "chunk" is then their first decode), and so does every chunk once the first reply
    has said what was cached. Only a chunk in one of the worker's steps in flight holds it back
    (a first chunk refused for blocks is no longer there, and its request plans it again)."""
    return (request.cached_tokens is None and request.max_tokens - len(request.output) <= 1
            and any(item.seq_id == request.seq_id for step in worker.in_flight for item in step.plan.work))


def _unplanned_prefill(request: RequestState, plan: StepBuilder) -> bool:
    """Whether a prefilling request has prompt tokens, or the first decode after its last chunk,
    that neither the steps in flight nor `plan` compute: a next step should come soon for it."""
    planned = plan.planned(request.seq_id or "")
    return request.num_computed + (planned[0] if planned else 0) < request.worker_tokens


class StepPlanner:
    def __init__(self, config: CoreConfig, vtc: VirtualTokenCounter, book: RequestBook,
                 counts: CoreCounters, clock: Callable[[], float], new_id: Callable[[], str]) -> None:
        self._config = config
        self._vtc = vtc
        self._book = book
        self._counts = counts
        self._clock = clock
        self._new_id = new_id

    def fill(self, worker: WorkerState, plan: StepBuilder) -> None:
        """Adds the worker's next step's work to `plan` (module docstring for the order)."""
        # One policy for the whole step: admissions and preemptions only move requests between
        # the worker's waiting and running ones, whose union decides it.
        policy = effective_policy(self._config.policy, worker.pending, worker.running)
        prefill_turn = self._prefill_turn(worker)
        if prefill_turn is None:
            self._plan_decodes(worker, plan, policy)
            self._plan_prefill(worker, plan, policy)
        elif prefill_turn:
            self._plan_prefill(worker, plan, policy)
            if not plan.has_work:
                self._plan_decodes(worker, plan, policy)
        else:
            self._plan_decodes(worker, plan, policy)
        self._grant_runs(worker, plan, policy)


    def _prefill_turn(self, worker: WorkerState) -> bool | None:
        """None: prefill and decodes share the step. Otherwise whether this
        step of the alternating mode is the prefill one."""
        if self._config.prefill_mode is PrefillMode.MIXED:
            return None
        if not worker.active or not (worker.prefilling or worker.pending):
            return None
        return not worker.last_step_was_prefill

    def _plan_decodes(self, worker: WorkerState, plan: StepBuilder, policy: Policy) -> None:
        config = self._config
        drafting = speculating(config.speculative_tokens, config.speculative_max_batch, len(worker.active))
        for request in sorted(worker.active, key=lambda r: r.running_key):
            if request.phase is not Phase.ACTIVE or request.worker_id != worker.worker_id:
                continue  # preempted while this step was being planned
            if request.outputs_if_drafts_kept >= request.max_tokens:
                continue  # its last tokens are (or, as drafts, may be) sampled in a step in flight
            if plan.token_budget < 1:
                return
            needed = blocks_to_grow(request.num_computed, 1, worker.spec.block_size, request.kv_cap_tokens)
            if self._make_room(worker, plan, request, needed):
                assert request.seq_id is not None
                allowed = drafting and drafts_allowed(request.kv_cap_tokens, request.sampling.is_greedy,
                                                      config.speculative_sampled)
                drafts, extra = self._draft_allowance(worker, plan, request, needed) if allowed else (0, 0)
                plan.add(request.seq_id, 1, needed + extra, is_decode=True, drafts=drafts)

    def _grant_runs(self, worker: WorkerState, plan: StepBuilder, policy: Policy) -> None:
        """Once the step's admissions are planned: lets its decodes, and the chunks that end
        their prompts (their sequences decode on from the token the chunk samples), run
        several times (allowances/decode_steps.py), unless a request waits that the next
        step should take soon: one a step could admit, or a prefilling one with chunks left.
        While the worker prefills, at most `prefill_decode_steps` runs (1 by default: a new
        request's first token comes with its prefill's step); otherwise `decode_steps`, or more
        where the worker's runs are quick (`decode_step_ms`, quick_runs). Requests queued behind
        a full batch end the runs when running ones finish to free them slots
        (runs_until_slots_free)."""
        config = self._config
        waiting = self.admits_waiting(worker, policy) or any(_unplanned_prefill(r, plan) for r in worker.prefilling)
        if not multi_stepping(config.decode_steps, waiting):
            return
        prefills = bool(worker.prefilling) or plan.has_prefill
        if prefills:
            most_runs = min(config.prefill_decode_steps, config.decode_steps)
        else:
            most_runs = max(config.decode_steps, quick_runs(config.decode_step_ms, worker.decode_run_ms,
                                                            worker.decode_run_decodes, len(worker.running)))
            if most_runs > config.decode_steps:
                plan.runs_ms = config.decode_step_ms    # the worker keeps the budget if the runs slow
        if worker.pending and most_runs > 1:
            most_runs = min(most_runs, runs_until_slots_free(
                [left for r in worker.active if (left := r.max_tokens - r.outputs_if_drafts_kept) > 0],
                len(worker.pending)))
        if most_runs <= 1:
            return
        for request in sorted(worker.running, key=lambda r: r.running_key):
            planned = plan.planned(request.seq_id or "")
            if planned is None or request.kv_cap_tokens:
                continue
            num_tokens, blocks, is_decode, drafts = planned
            if not is_decode and request.num_computed + num_tokens < request.worker_tokens:
                continue    # a chunk short of its prompt's end samples nothing to decode on from
            assert request.seq_id is not None
            allowance = runs_allowance(
                decode_steps=most_runs, drafts=drafts,
                outputs_left=request.max_tokens - request.outputs_if_drafts_kept,
                num_computed=request.num_computed + num_tokens - 1,
                held_blocks=worker.blocks_held(request) + blocks, spare_blocks=plan.available_blocks,
                block_size=worker.spec.block_size)
            if allowance.runs > 1:
                plan.grant_runs(request.seq_id, *allowance)

    def admits_waiting(self, worker: WorkerState, policy: Policy | None = None) -> bool:
        """Whether a request waits on the worker that its next step could admit: a batch slot
        is free, or a running request would hand its slot over (slot fairness). Requests
        queued behind a full batch that keeps its slots wait for one to free either way.
        `policy`: the worker's effective policy, when the caller has it."""
        if not worker.pending:
            return False
        config = self._config
        if len(worker.running) < config.max_batch_size:
            return True
        policy = policy or effective_policy(config.policy, worker.pending, worker.running)
        if self._no_slot_to_hand_over(worker, policy):
            return False
        candidate = pick_next(worker.pending, policy, self._vtc)
        return candidate is not None and slot_victim(
            candidate, worker.running, worker.pending, (), policy, config.max_batch_size) is not None

    def _no_slot_to_hand_over(self, worker: WorkerState, policy: Policy) -> bool:
        """Whether the batch is full and no running request would give its slot to any waiting
        one: none has a lower priority, and slot fairness (vtc) is off."""
        return (len(worker.running) >= self._config.max_batch_size and policy is not Policy.VTC
                and max(r.priority for r in worker.pending) <= min(r.priority for r in worker.running))

    def _draft_allowance(self, worker: WorkerState, plan: StepBuilder, request: RequestState,
                         needed: int) -> tuple[int, int]:
        """(draft tokens, extra blocks) for a decode that takes `needed` blocks for its own token."""
        return draft_allowance(
            speculative_tokens=self._config.speculative_tokens,
            outputs_left=request.max_tokens - request.outputs_if_drafts_kept,
            token_budget=plan.token_budget, num_computed=request.num_computed,
            held_blocks=worker.blocks_held(request) + needed, spare_blocks=plan.available_blocks - needed,
            block_size=worker.spec.block_size)

    def _plan_prefill(self, worker: WorkerState, plan: StepBuilder, policy: Policy) -> None:
        for request in sorted(worker.prefilling, key=lambda r: r.running_key):
            if request.phase is not Phase.PREFILLING:
                continue
            if plan.token_budget < 1:
                return
            self._plan_chunk(worker, plan, request)
        self._plan_admissions(worker, plan, policy)

    def _plan_chunk(self, worker: WorkerState, plan: StepBuilder, request: RequestState) -> None:
        # Once its last chunk is in flight, the next "chunk" is its first decode.
        wanted = min(request.worker_tokens - request.num_computed,
                     self._config.prefill_chunk_size, plan.token_budget)
        if wanted <= 0 or not request.wants_more or one_token_chunk_in_flight(request, worker):
            return
        block_size, cap = worker.spec.block_size, request.kv_cap_tokens
        num_tokens = tokens_that_fit(request.num_computed, plan.available_blocks, block_size, wanted, cap)
        if num_tokens == 0:
            if not self._make_room(worker, plan, request, blocks_to_grow(request.num_computed, 1, block_size, cap)):
                return
            num_tokens = tokens_that_fit(request.num_computed, plan.available_blocks, block_size, wanted, cap)
        assert request.seq_id is not None
        plan.add(request.seq_id, num_tokens, blocks_to_grow(request.num_computed, num_tokens, block_size, cap),
                 is_decode=False)

    def _plan_admissions(self, worker: WorkerState, plan: StepBuilder, policy: Policy) -> None:
        config = self._config
        if worker.refused_allocation or not worker.pending or self._no_slot_to_hand_over(worker, policy):
            return
        block_size, min_shared = worker.spec.block_size, config.prefix_wait_min_tokens
        blocked = blocked_by_leaders(worker.pending, worker.prefilling, block_size, min_shared)
        while worker.pending and plan.token_budget >= 1:
            candidates = [r for r in worker.pending if r.request_id not in blocked] if blocked else worker.pending
            request = pick_next(candidates, policy, self._vtc)
            if request is None:
                return
            if len(worker.running) >= config.max_batch_size and not self._free_a_slot(worker, plan, request, policy):
                return
            gate = gates.holding_gate(worker.reserved_kv_tokens, request.kv_reservation,
                                      config.max_active_kv_tokens, request.cache_tokens(request.known_tokens),
                                      block_size,
                                      plan.available_blocks)
            if gate is not None:
                self._counts.count_hold(request, gate)
                return  # nothing behind it overtakes it
            self._admit(worker, plan, request)
            blocked |= blocked_by_leaders(worker.pending, [request], block_size, min_shared)

    def _free_a_slot(self, worker: WorkerState, plan: StepBuilder, candidate: RequestState,
                     policy: Policy) -> bool:
        """Preempts the running request that gives its batch slot to `candidate`;
        False when none does."""
        admitted_now = {new.seq_id for new in plan.new_sequences}
        victim = slot_victim(candidate, worker.running, worker.pending, admitted_now,
                             policy, self._config.max_batch_size)
        if victim is None:
            return False
        self._book.preempt(worker, victim, plan)
        return True

    def _admit(self, worker: WorkerState, plan: StepBuilder, request: RequestState) -> None:
        seq_id = sequence_id(request.request_id, self._new_id())
        plan.new_sequences.append(self._book.admit(worker, request, seq_id, now=self._clock()))
        num_tokens = min(request.known_tokens, self._config.prefill_chunk_size, plan.token_budget)
        plan.add(seq_id, num_tokens, blocks_for(request.cache_tokens(num_tokens), worker.spec.block_size),
                 is_decode=False)

    def _make_room(self, worker: WorkerState, plan: StepBuilder, requester: RequestState,
                   needed_blocks: int) -> bool:
        """Preempts until `needed_blocks` are available; False when the
        requester itself had to go."""
        victims, keeps_place = victims_for_room(
            worker.running, requester, needed_blocks - plan.available_blocks,
            freed_blocks=lambda r: worker.blocks_held(r) + plan.planned_blocks(r.seq_id or ""))
        for victim in victims:
            self._book.preempt(worker, victim, plan)
        return keeps_place
