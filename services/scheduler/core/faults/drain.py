"""Workers leaving on purpose (a worker's SIGTERM, the DrainWorker RPC).

A draining worker is routed nothing new (routing.choose_worker skips it). What
it holds moves to the workers that are not draining, the way a failed
worker's requests do (failover.py): waiting ones as they are, running ones
resumed there by recompute from their prompt and the tokens already streamed,
so their clients see no gap and no repeat. With no other worker it keeps
serving what it holds. The worker asks again until nothing is left on it; each
call moves what it can, so a worker that registers meanwhile takes over. Once
nothing is left the caller removes the worker.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from services.scheduler.core.faults.failover import Failover
from services.scheduler.core.state import WorkerState
from services.scheduler.core.types import RequestUpdate


@dataclass(frozen=True)
class DrainOutcome:
    known: bool              # False: no such worker (nothing to hand over)
    started: bool = False    # this call began the drain
    moved: int = 0           # requests handed to other workers (or ended) by this call
    remaining: int = 0       # requests still on the draining worker
    updates: tuple[RequestUpdate, ...] = ()

    @property
    def drained(self) -> bool:
        """Nothing is left on a known worker: it may go."""
        return self.known and self.remaining == 0


def drain(workers: Mapping[str, WorkerState], worker_id: str, failover: Failover) -> DrainOutcome:
    """Marks `worker_id` draining and moves its requests to the workers that are not."""
    worker = workers.get(worker_id)
    if worker is None:
        return DrainOutcome(known=False)
    started = not worker.draining
    worker.draining = True
    others = [other for other in workers.values() if not other.draining]
    held = worker.load
    if not others or not held:
        return DrainOutcome(known=True, started=started, remaining=held)
    stranded = failover.release(worker)
    updates = failover.rehome(stranded, others, f"worker {worker_id} is draining")
    return DrainOutcome(known=True, started=started, moved=held - worker.load,
                        remaining=worker.load, updates=tuple(updates))
