"""Requests of a gone worker: waiting ones move, running ones resume elsewhere or end."""

from __future__ import annotations

from services.scheduler.core.fairness.counters import CoreCounters
from services.scheduler.core.faults.failover import Failover
from services.scheduler.core.fairness.vtc import VirtualTokenCounter
from services.scheduler.core.request_book import RequestBook
from services.scheduler.core.routing import SessionMap, session_key
from services.scheduler.core.state import Phase, RequestState, WorkerState
from services.scheduler.core.types import FinishReason, Gate, RequestSpec

from tests.unit.scheduler.plain_state import make_request, make_worker


def _setup(max_active_kv_tokens: int = 1000) -> tuple[RequestBook, SessionMap, Failover, WorkerState]:
    book = RequestBook(VirtualTokenCounter(input_weight=1.0, output_weight=2.0), CoreCounters())
    sessions = SessionMap()
    return book, sessions, Failover(book, sessions, max_active_kv_tokens), make_worker("w0")


def _queue(book: RequestBook, worker: WorkerState, arrival: int, session: str = "") -> RequestState:
    request = make_request(arrival)
    request.spec = RequestSpec(request_id=request.request_id, prompt_token_ids=request.prompt, max_tokens=8,
                               session_id=session)
    book.add(worker, request)
    return request


def test_release_empties_the_worker_and_sorts_what_ran_from_what_never_did() -> None:
    book, sessions, failover, gone = _setup()
    fresh, preempted, running = _queue(book, gone, 1, session="s"), _queue(book, gone, 2), _queue(book, gone, 3)
    sessions.remember(session_key(fresh.spec), "w0")
    for request in (preempted, running):
        book.admit(gone, request, f"s{request.arrival_order}", now=5.0)
    book.preempt(gone, preempted)
    stranded = failover.release(gone)
    assert stranded.fresh == [fresh] and stranded.resumable == [preempted, running]
    assert (gone.pending, gone.running, gone.frees, gone.reserved_kv_tokens) == ([], [], [], 0)
    assert running.resumed and running.seq_id is None and book.by_seq == {}
    assert sessions.get(session_key(fresh.spec)) is None


def test_rehome_moves_everything_to_the_least_loaded_worker_left_with_its_session() -> None:
    book, sessions, failover, gone = _setup()
    fresh, running = _queue(book, gone, 1, session="s"), _queue(book, gone, 2)
    book.admit(gone, running, "s2", now=5.0)
    busy, idle = make_worker("w1"), make_worker("w2")
    busy.pending.extend([make_request(8, worker_id="w1"), make_request(9, worker_id="w1")])
    stranded = failover.release(gone)
    assert failover.rehome(stranded, [busy, idle], "w0 went away") == []
    assert idle.pending == [running, fresh] and (running.worker_id, fresh.worker_id) == ("w2", "w2")
    assert running.phase is Phase.PENDING and sessions.get(session_key(fresh.spec)) == "w2"
    assert book.waiting.waiting("a") == 2 and book.counts.migrations == 1


def test_with_no_worker_left_running_requests_end_and_waiting_ones_are_rejected() -> None:
    book, _, failover, gone = _setup()
    fresh, running, preempted = _queue(book, gone, 1), _queue(book, gone, 2), _queue(book, gone, 3)
    for request in (running, preempted):
        book.admit(gone, request, f"s{request.arrival_order}", now=5.0)
    book.preempt(gone, preempted)                      # waiting again, and counted as waiting
    updates = failover.rehome(failover.release(gone), [], "w0 went away")
    by_id = {u.request_id: u for u in updates}
    assert by_id[preempted.request_id].finish is not None
    finish = by_id[running.request_id].finish
    assert finish is not None and finish.reason is FinishReason.ERROR
    assert finish.message == "w0 went away; no worker is left to resume it"
    rejection = by_id[fresh.request_id].rejection
    assert rejection is not None and rejection.gate is Gate.NO_WORKER
    assert book.requests == {} and len(book.waiting) == 0


def test_a_running_request_that_can_never_fit_the_worker_left_ends_with_the_reason() -> None:
    book, _, failover, gone = _setup()
    running = _queue(book, gone, 1)
    book.admit(gone, running, "s1", now=5.0)
    small = make_worker("w1", num_blocks=2)          # 8 tokens: prompt 4 + max_tokens 8 need 3 blocks
    updates = failover.rehome(failover.release(gone), [small], "w0 went away")
    finish = updates[0].finish
    assert finish is not None and "needs 3 KV blocks" in finish.message and small.pending == []
    assert book.requests == {} and book.counts.migrations == 0
