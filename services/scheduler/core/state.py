"""Mutable per-request and per-worker state owned by the scheduling core."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from enum import StrEnum

from common.step import KvPolicy, PoolStats, StepOutput, StepBatch
from common.types import SamplingParams, TokenLogprob

from services.scheduler.core.types import Gate, RequestSpec, WorkerSpec
from services.scheduler.core.fairness.vtc import sane_weight

MAX_NOTED_ADAPTERS = 64


class Phase(StrEnum):
    PENDING = "pending"        # waiting for admission (new, or back after a preemption)
    PREFILLING = "prefilling"  # registered on the worker, known tokens not all computed
    ACTIVE = "active"          # decoding: one uncomputed token, the last sampled one


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass(eq=False)
class RequestState:
    spec: RequestSpec
    client_id: str
    max_tokens: int
    arrival_s: float
    arrival_order: int
    worker_id: str
    phase: Phase = Phase.PENDING
    output: list[int] = field(default_factory=list)
    seq_id: str | None = None       # the incarnation the worker knows, if any
    num_computed: int = 0
    cached_tokens: int | None = None  # from the first incarnation's first result
    queue_wait_s: float | None = None  # arrival to first admission, once admitted
    admitted_once: bool = False
    resumed: bool = False           # preempted: goes to the front of its queue
    # Steps in flight expected to end with a sample for this request: the worker
    # holds those tokens, the scheduler does not know them yet.
    inflight_samples: int = 0
    # Speculative tokens granted to the steps in flight: at most that many more
    # tokens than inflight_samples may come back.
    inflight_drafts: int = 0
    held_by: set[Gate] = field(default_factory=set)
    # Times it was running on a worker that failed and moved on (failover.py, MAX_MIGRATIONS).
    failovers: int = 0
    # sampling.prompt_logprobs: what the workers scored, by position (a recompute scores
    # again); sent once, with the first tokens.
    prompt_logprobs: dict[int, TokenLogprob] = field(default_factory=dict)
    prompt_logprobs_sent: bool = False
    # What its KV keeps past a budget (its kv_policy, else the deployment's), and the most
    # tokens that leaves in the cache (0: "full", no bound; whole blocks of its worker).
    kv_policy: KvPolicy = KvPolicy()
    kv_cap_tokens: int = 0

    def cache_tokens(self, num_tokens: int) -> int:
        """Of `num_tokens` tokens of this request, how many its cache holds."""
        return min(num_tokens, self.kv_cap_tokens) if self.kv_cap_tokens else num_tokens

    def note_prompt_logprobs(self, start: int, logprobs: tuple[TokenLogprob, ...]) -> None:
        for offset, logprob in enumerate(logprobs):
            if 0 < start + offset < len(self.spec.prompt_token_ids):
                self.prompt_logprobs[start + offset] = logprob

    def take_prompt_logprobs(self) -> tuple[TokenLogprob, ...]:
        """The prompt's logprobs, positions 1 on, the first time they are all known
        (a continuation's client has them already); else ()."""
        if self.prompt_logprobs_sent or self.spec.resume_token_ids or not self.sampling.prompt_logprobs:
            return ()
        positions = range(1, len(self.spec.prompt_token_ids))
        if any(position not in self.prompt_logprobs for position in positions):
            return ()
        self.prompt_logprobs_sent = True
        return tuple(self.prompt_logprobs.pop(position) for position in positions)

    @classmethod
    def arriving(cls, spec: RequestSpec, client_id: str, max_tokens: int, arrival_s: float,
                 arrival_order: int, worker_id: str, kv_policy: KvPolicy = KvPolicy(),
                 kv_cap_tokens: int = 0) -> RequestState:
        """A request as it is submitted. A continuation starts with the tokens it
        resumes from as output, as if preempted after them: recomputed from prompt
        and output when admitted, and first in its queue."""
        resumed = spec.resume_token_ids
        return cls(spec=spec, client_id=client_id, max_tokens=max_tokens, arrival_s=arrival_s,
                   arrival_order=arrival_order, worker_id=worker_id, output=list(resumed), resumed=bool(resumed),
                   kv_policy=kv_policy, kv_cap_tokens=kv_cap_tokens)

    @property
    def started(self) -> bool:
        """Admitted before, here or (a continuation) by the scheduler it continues
        from: its client may have tokens already, so it never times out in the
        queue and never waits for another request's shared prefix."""
        return self.admitted_once or bool(self.spec.resume_token_ids)

    @property
    def request_id(self) -> str:
        return self.spec.request_id

    @property
    def priority(self) -> int:
        return self.spec.priority

    @property
    def user(self) -> str:
        """The end user within client_id ("" for none): orders the client's own requests."""
        return self.spec.user

    @property
    def weight(self) -> float:
        """The client's VTC weight as this request carries it (see vtc.sane_weight)."""
        return sane_weight(self.spec.weight)

    @property
    def prompt(self) -> tuple[int, ...]:
        return self.spec.prompt_token_ids

    @property
    def sampling(self) -> SamplingParams:
        return self.spec.sampling

    @property
    def known_tokens(self) -> int:
        return len(self.spec.prompt_token_ids) + len(self.output)

    @property
    def worker_tokens(self) -> int:
        """Tokens the worker will hold once the steps in flight have run."""
        return self.known_tokens + self.inflight_samples

    @property
    def wants_more(self) -> bool:
        """Whether one more sampled token stays within max_tokens, counting the
        samples still in flight."""
        return len(self.output) + self.inflight_samples < self.max_tokens

    @property
    def outputs_if_drafts_kept(self) -> int:
        """Output tokens once the steps in flight have run, if every draft in them is kept."""
        return len(self.output) + self.inflight_samples + self.inflight_drafts

    @property
    def kv_reservation(self) -> int:
        """Tokens counted against the active-KV gate while admitted."""
        return self.cache_tokens(len(self.spec.prompt_token_ids) + self.max_tokens)

    @property
    def running_key(self) -> tuple[int, int]:
        """Ascending: served first; the largest key is the first to be preempted."""
        return (-self.spec.priority, self.arrival_order)


@dataclass(frozen=True)
class InFlightStep:
    plan: StepBatch
    available_after: int          # pool blocks the plan expects to be left once it has run
    sampling: frozenset[str]      # sequences the plan expects to sample
    decode_only: bool = False     # every work item a decode: its time, over its runs, is a run's


@dataclass(eq=False)
class WorkerState:
    spec: WorkerSpec
    pool: PoolStats
    last_heartbeat_s: float
    pending: list[RequestState] = field(default_factory=list)
    prefilling: list[RequestState] = field(default_factory=list)
    active: list[RequestState] = field(default_factory=list)
    # Sequences to free in the next step, and the blocks that should release.
    frees: list[str] = field(default_factory=list)
    releasing_blocks: int = 0
    reserved_kv_tokens: int = 0
    # Sent and not yet applied, oldest first. Planning counts their work as done
    # (num_computed of their requests already includes it).
    in_flight: list[InFlightStep] = field(default_factory=list)
    last_step_was_prefill: bool = False
    # The worker refused an allocation in its last step: our estimate of its
    # pool was too optimistic, so nothing is admitted until a step succeeds.
    refused_allocation: bool = False
    refusal_seen_by_step: int = 0   # only a step planned after this one can lift the refusal
    steps: int = 0
    last_step_ms: float = 0.0
    last_batch_size: int = 0
    # The last decode-only step's time a run and its decodes (quick_runs): 0 until one ran.
    decode_run_ms: float = 0.0
    decode_run_decodes: int = 0
    # Leaving on purpose (drain.py): nothing new is routed to it.
    draining: bool = False
    # LoRA adapters this worker was last sent requests of, most recent last: it likely holds
    # them resident (routing prefers it for their requests). At most MAX_NOTED_ADAPTERS.
    adapters: dict[str, None] = field(default_factory=dict)

    def note_adapter(self, name: str) -> None:
        if not name:
            return
        self.adapters.pop(name, None)
        self.adapters[name] = None
        while len(self.adapters) > MAX_NOTED_ADAPTERS:
            del self.adapters[next(iter(self.adapters))]

    @property
    def worker_id(self) -> str:
        return self.spec.worker_id

    @property
    def running(self) -> list[RequestState]:
        return self.prefilling + self.active

    @property
    def load(self) -> int:
        return len(self.pending) + len(self.prefilling) + len(self.active)

    def settle(self, outcome: StepOutput) -> tuple[InFlightStep, bool]:
        """Retires the oldest step in flight, which `outcome` answers: the pool
        becomes what the worker reports, and the later steps' estimates move by
        the difference from what this one expected. Returns the step and whether
        a refusal in it only echoes the last one (it was planned before that
        refusal was known); a step planned after it that ran lifts the refusal."""
        done = self.in_flight.pop(0)
        echoes_refusal = self.refused_allocation and done.plan.step_id <= self.refusal_seen_by_step
        if not echoes_refusal:
            self.refused_allocation = False
        surprise = outcome.pool.available_blocks - done.available_after
        self.in_flight = [replace(step, available_after=step.available_after + surprise)
                          for step in self.in_flight]
        self.pool = outcome.pool
        self.steps += 1
        self.last_step_ms = outcome.forward_ms
        self.last_batch_size = len(done.plan.work)
        if done.decode_only and outcome.forward_ms > 0:
            # the runs it ran: fewer than asked where its sequences stopped early (caps, EOS)
            runs = outcome.runs or max(item.decode_steps for item in done.plan.work)
            self.decode_run_ms, self.decode_run_decodes = outcome.forward_ms / runs, len(done.plan.work)
        return done, echoes_refusal

    def note_refusal(self) -> None:
        """The worker refused an allocation: admit nothing until a step planned
        after the ones now in flight has run."""
        self.refused_allocation = True
        self.refusal_seen_by_step = self.in_flight[-1].plan.step_id if self.in_flight else 0

    def free_in_next_step(self, seq_id: str, blocks: int) -> None:
        """Frees a sequence in the next step planned; its blocks count as
        available to that step."""
        self.frees.append(seq_id)
        self.releasing_blocks += blocks

    def take_frees(self) -> tuple[list[str], int]:
        """The sequences to free in the step being planned and the blocks they
        release; the next step starts with none."""
        frees, releasing = self.frees, self.releasing_blocks
        self.frees, self.releasing_blocks = [], 0
        return frees, releasing

    def blocks_held(self, request: RequestState) -> int:
        return blocks_for(request.cache_tokens(request.num_computed), self.spec.block_size)

    def available_blocks(self) -> int:
        """Free and evictable blocks once the steps in flight have run (estimate)."""
        return self.in_flight[-1].available_after if self.in_flight else self.pool.available_blocks

    def tokens_in_flight(self) -> Counter[str]:
        """Tokens per sequence that the steps in flight will compute."""
        counts: Counter[str] = Counter()
        for step in self.in_flight:
            for item in step.plan.work:
                counts[item.seq_id] += item.num_tokens
        return counts
