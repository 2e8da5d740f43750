"""Which worker a request goes to: its session's worker while that one is
there, else the worker holding (or about to hold) the longest prefix of its
prompt that it can reuse (one of its own cache salt), else the least loaded.
Cache affinity gives way to load (`balanced`): a worker more than `load_slack`
requests and BALANCE_RATIO times above the least loaded one is not chosen for
its cache, so a tenant whose prompts all share one system prompt spreads over
the workers (each new one then caches the prompt) instead of queueing on the
first that cached it while the others idle.
A session remembers its last worker; sessions least recently used are
forgotten first, and all of a worker's sessions when the worker goes. A
session is its client's, salt's and id's together (session_key): a client that
names another client's session id neither follows nor moves that session.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence

from services.scheduler.core.prefix_share import shared_prefix_tokens
from services.scheduler.core.recent_prefixes import RecentPrefixes
from services.scheduler.core.state import RequestState, WorkerState
from services.scheduler.core.types import RequestSpec

MAX_REMEMBERED_SESSIONS = 65536
BALANCE_RATIO = 1.5      # with the slack: how far above the least loaded a cache holder may be
# Why a request went where it went (`route_with_reason`; the scheduler counts them):
# its session's worker; the one holding the longest cached prefix; not that one, which was
# overloaded (`balanced`); no cached prefix anywhere, the least loaded.
ROUTING_REASONS = ("session", "cache", "load", "least_loaded")


def session_key(spec: RequestSpec) -> Hashable:
    """What a request's session is remembered under: its client, cache salt and session id
    ("" without a session id), so that sessions of different clients or salts that happen to
    share an id never route (nor time) each other's requests."""
    return (spec.client_id, spec.cache_salt, spec.session_id) if spec.session_id else ""


class SessionMap:
    """session (session_key) -> worker_id, least recently used sessions forgotten first."""

    def __init__(self, capacity: int = MAX_REMEMBERED_SESSIONS) -> None:
        self._capacity = capacity
        self._workers: OrderedDict[Hashable, str] = OrderedDict()

    def get(self, session_id: Hashable) -> str | None:
        worker_id = self._workers.get(session_id)
        if worker_id is not None:
            self._workers.move_to_end(session_id)
        return worker_id

    def remember(self, session_id: Hashable, worker_id: str) -> None:
        self._workers[session_id] = worker_id
        self._workers.move_to_end(session_id)
        while len(self._workers) > self._capacity:
            self._workers.popitem(last=False)

    def forget_worker(self, worker_id: str) -> None:
        for session_id in [s for s, w in self._workers.items() if w == worker_id]:
            del self._workers[session_id]


def balanced(workers: Sequence[WorkerState], load_slack: int,
             loads: Sequence[int] | None = None) -> list[WorkerState]:
    """The workers not overloaded against the least loaded one: at most `load_slack` requests
    above its load, or at most BALANCE_RATIO times it (so the least loaded is always one).
    `loads`: the workers' loads, aligned with them (computed when not given)."""
    loads = [worker.load for worker in workers] if loads is None else loads
    lightest = min(loads)
    return [worker for worker, load in zip(workers, loads)
            if load - lightest <= load_slack or load <= lightest * BALANCE_RATIO]


def choose_worker(workers: Sequence[WorkerState], session_worker: str | None,
                  cached_prefix_tokens: Mapping[str, int], adapter: str = "",
                  load_slack: int | None = None) -> WorkerState | None:
    """The session's worker if it is still there; otherwise, among the workers not
    overloaded (`balanced`; all of them with `load_slack` None), the one holding
    the longest cached prefix, ties going to one that served `adapter` lately (a LoRA
    adapter's requests: it likely holds the adapter), then to the least loaded, then to
    the one with the most never-used blocks (so cold prompts spread over idle workers
    instead of all landing on the first). A draining worker is never chosen.
    (Each worker's load is counted once: at 64 workers this runs for every admission.)"""
    workers = [worker for worker in workers if not worker.draining]
    if not workers:
        return None
    if session_worker is not None:
        for worker in workers:
            if worker.worker_id == session_worker:
                return worker
    loads = [worker.load for worker in workers]
    if load_slack is not None:
        kept = balanced(workers, load_slack, loads)
        if len(kept) < len(workers):
            workers, loads = kept, [worker.load for worker in kept]
    if not cached_prefix_tokens and not adapter:     # most admissions: no cached prefix anywhere
        return min(zip(workers, loads), key=lambda pair: (pair[1], pair[0].reserved_kv_tokens,
                                                          -pair[0].pool.free_blocks, pair[0].worker_id))[0]
    return min(zip(workers, loads), key=lambda pair: (
        -cached_prefix_tokens.get(pair[0].worker_id, 0), bool(adapter) and adapter not in pair[0].adapters,
        pair[1], pair[0].reserved_kv_tokens, -pair[0].pool.free_blocks, pair[0].worker_id))[0]


def prefix_hints(prompt: tuple[int, ...], workers: Sequence[WorkerState],
                 cached_prefix_tokens: Mapping[str, int], min_tokens: int, cache_salt: str = "",
                 recent: RecentPrefixes | None = None) -> dict[str, int]:
    """The index's cached-prefix hints (worker_id -> tokens), raised where a
    worker is about to hold a longer prefix: one of its queued or prefilling
    requests with the same `cache_salt` shares it (prefix_share.py; 0
    `min_tokens` turns that off). `recent` finds those requests by how they start
    (recent_prefixes.py); without it each worker's lists are scanned."""
    hints = dict(cached_prefix_tokens)
    if min_tokens <= 0 or len(workers) < 2:     # nothing to choose between
        return hints
    if recent is not None:
        by_worker: dict[str, list[RequestState]] = {}
        for request in recent.candidates(prompt, cache_salt):
            by_worker.setdefault(request.worker_id, []).append(request)
        known = {worker.worker_id for worker in workers} if by_worker else set()
        others = {worker_id: queued[::-1] for worker_id, queued in by_worker.items() if worker_id in known}
    else:
        others = {worker.worker_id: [*worker.pending, *worker.prefilling] for worker in workers}
    for worker_id, queued in others.items():
        shared = shared_prefix_tokens(prompt, queued, min_tokens, cache_salt) if queued else 0
        if shared > hints.get(worker_id, 0):
            hints[worker_id] = shared
    return hints


def route(prompt: tuple[int, ...], session_id: Hashable, workers: Sequence[WorkerState], sessions: SessionMap,
          cached_prefix_tokens: Mapping[str, int], min_tokens: int, cache_salt: str = "",
          adapter: str = "", load_slack: int | None = None) -> WorkerState | None:
    """`route_with_reason`'s worker."""
    return route_with_reason(prompt, session_id, workers, sessions, cached_prefix_tokens, min_tokens,
                             cache_salt, adapter, load_slack)[0]


def route_with_reason(prompt: tuple[int, ...], session_id: Hashable, workers: Sequence[WorkerState],
                      sessions: SessionMap, cached_prefix_tokens: Mapping[str, int], min_tokens: int,
                      cache_salt: str = "", adapter: str = "",
                      load_slack: int | None = None,
                      recent: RecentPrefixes | None = None) -> tuple[WorkerState | None, str]:
    """The worker for a new request (None: no worker): its session's, else among the
    workers not overloaded (`balanced`, with `load_slack`) the one holding or about to
    hold the longest prefix of `prompt` under its `cache_salt` (the index's hints are
    looked up with it), else one holding its LoRA `adapter`, else the least loaded. The
    chosen worker notes the adapter."""
    session_worker = sessions.get(session_id) if session_id else None
    hints = prefix_hints(prompt, workers, cached_prefix_tokens, min_tokens, cache_salt, recent)
    worker = choose_worker(workers, session_worker, hints, adapter, load_slack)
    if worker is None:
        return None, ""
    worker.note_adapter(adapter)
    return worker, routing_reason(worker, session_worker, workers, hints)


def routing_reason(worker: WorkerState, session_worker: str | None, workers: Sequence[WorkerState],
                   hints: Mapping[str, int]) -> str:
    """Which of ROUTING_REASONS put a request on `worker` (chosen by `choose_worker`)."""
    if worker.worker_id == session_worker:
        return "session"
    if not any(hints.values()):
        return "least_loaded"
    longest = max((hints.get(w.worker_id, 0) for w in workers if not w.draining), default=0)
    held = hints.get(worker.worker_id, 0)
    if held < longest:
        return "load"
    return "cache" if held else "least_loaded"
