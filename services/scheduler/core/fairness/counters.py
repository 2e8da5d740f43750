"""The core's running totals (admissions, preemptions, migrations, finishes,
rejections and holds by gate, queue waits) and the CoreStats snapshot built
from them and the workers.

Invariants: every counter only grows; a request counts once per gate that
held it (RequestState.held_by), however many steps the gate holds it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from services.scheduler.core.state import RequestState, WorkerState
from services.scheduler.core.types import (ClientCounter, CoreStats, FinishReason, Gate, Policy, QuotaUsage,
                                          WorkerSummary)


@dataclass
class CoreCounters:
    admitted: int = 0
    preemptions: int = 0
    migrations: int = 0
    finished: Counter[str] = field(default_factory=Counter)
    rejections: Counter[str] = field(default_factory=Counter)
    holds: Counter[str] = field(default_factory=Counter)
    routed: Counter[str] = field(default_factory=Counter)   # requests placed, by routing.ROUTING_REASONS
    queue_waits: list[float] = field(default_factory=list)  # since the last drain

    def count_admission(self, queue_wait_s: float) -> None:
        self.admitted += 1
        self.queue_waits.append(queue_wait_s)

    def count_finish(self, reason: FinishReason) -> None:
        self.finished[reason.value] += 1

    def count_rejection(self, gate: Gate) -> None:
        self.rejections[gate.value] += 1

    def count_route(self, reason: str) -> None:
        self.routed[reason] += 1

    def count_hold(self, request: RequestState, gate: Gate) -> None:
        if gate not in request.held_by:
            request.held_by.add(gate)
            self.holds[gate.value] += 1

    def drain_queue_waits(self) -> list[float]:
        waits, self.queue_waits = self.queue_waits, []
        return waits


def summarize_worker(worker: WorkerState, healthy: bool) -> WorkerSummary:
    pool = worker.pool
    return WorkerSummary(
        worker_id=worker.worker_id, address=worker.spec.address, healthy=healthy,
        running=len(worker.running), pending=len(worker.pending), free_blocks=pool.free_blocks,
        cached_blocks=pool.cached_blocks, total_blocks=pool.total_blocks,
        used_blocks=pool.used_blocks, evictions=pool.evictions,
        last_step_ms=worker.last_step_ms, last_batch_size=worker.last_batch_size, steps=worker.steps,
        reserved_kv_tokens=worker.reserved_kv_tokens)


def core_stats(policy: Policy, counters: CoreCounters, workers: Iterable[WorkerState],
               clients: tuple[ClientCounter, ...], now: float, heartbeat_timeout_s: float,
               waiting_for_worker: int = 0, waiting_since_s: float | None = None,
               worker_recovery_s: float = 0.0, quotas: tuple[QuotaUsage, ...] = ()) -> CoreStats:
    workers = list(workers)
    summaries = tuple(summarize_worker(w, healthy=not w.draining and
                                       now - w.last_heartbeat_s <= heartbeat_timeout_s)
                      for w in workers)
    return CoreStats(
        policy=policy,
        pending=sum(len(w.pending) for w in workers),
        prefilling=sum(len(w.prefilling) for w in workers),
        active=sum(len(w.active) for w in workers),
        admitted=counters.admitted, finished=sum(counters.finished.values()),
        preemptions=counters.preemptions, migrations=counters.migrations,
        rejections=dict(counters.rejections), holds=dict(counters.holds), routed=dict(counters.routed),
        workers=summaries, clients=clients,
        reserved_kv_tokens=sum(w.reserved_kv_tokens for w in workers),
        finished_by_reason=dict(counters.finished),
        waiting_for_worker=waiting_for_worker,
        worker_wait_s=now - waiting_since_s if waiting_since_s is not None else 0.0,
        worker_recovery_s=worker_recovery_s, quotas=quotas,
    )
