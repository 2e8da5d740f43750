"""Which worker a new request goes to."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence

from services.scheduler.core.state import WorkerState

MAX_REMEMBERED_SESSIONS = 65536


class SessionMap:
    """session_id -> worker_id, least recently used sessions forgotten first."""

    def __init__(self, capacity: int = MAX_REMEMBERED_SESSIONS) -> None:
        self._capacity = capacity
        self._workers: OrderedDict[str, str] = OrderedDict()

    def get(self, session_id: str) -> str | None:
        worker_id = self._workers.get(session_id)
        if worker_id is not None:
            self._workers.move_to_end(session_id)
        return worker_id

    def remember(self, session_id: str, worker_id: str) -> None:
        self._workers[session_id] = worker_id
        self._workers.move_to_end(session_id)
        while len(self._workers) > self._capacity:
            self._workers.popitem(last=False)

    def forget_worker(self, worker_id: str) -> None:
        for session_id in [s for s, w in self._workers.items() if w == worker_id]:
            del self._workers[session_id]


def choose_worker(workers: Sequence[WorkerState], session_worker: str | None,
                  cached_prefix_tokens: Mapping[str, int]) -> WorkerState | None:
    """The session's worker if it is still there; otherwise the worker holding
    the longest cached prefix, ties going to the least loaded, then to the one
    with the most never-used blocks (so cold prompts spread over idle workers
    instead of all landing on the first)."""
    if not workers:
        return None
    if session_worker is not None:
        for worker in workers:
            if worker.worker_id == session_worker:
                return worker
    return min(workers, key=lambda w: (-cached_prefix_tokens.get(w.worker_id, 0), w.load,
                                        w.reserved_kv_tokens, -w.pool.free_blocks, w.worker_id))
