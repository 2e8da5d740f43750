"""The moves between a worker's lists, and the maps and counts they keep in step."""

from __future__ import annotations

from common.types import SamplingParams

from services.scheduler.core.fairness.counters import CoreCounters
from services.scheduler.core.fairness.vtc import VirtualTokenCounter
from services.scheduler.core.request_book import RequestBook, worker_sampling
from services.scheduler.core.state import Phase
from services.scheduler.core.step_builder import StepBuilder
from services.scheduler.core.types import FinishReason, Gate, RequestSpec

from tests.unit.scheduler.plain_state import make_request, make_worker


def _book() -> RequestBook:
    return RequestBook(VirtualTokenCounter(input_weight=1.0, output_weight=2.0), CoreCounters())


def test_admit_moves_pending_to_prefilling_and_charges_only_the_first_admission() -> None:
    book, worker = _book(), make_worker()
    request = make_request(1, prompt=(1, 2, 3, 4, 5), max_tokens=7)
    book.add(worker, request)
    assert book.requests == {"r1": request} and len(book.waiting) == 1
    new = book.admit(worker, request, "s1", now=3.0)
    assert (new.seq_id, new.prompt_token_ids, new.output_token_ids) == ("s1", (1, 2, 3, 4, 5), ())
    assert (request.phase, request.queue_wait_s, worker.prefilling, worker.pending) == \
        (Phase.PREFILLING, 2.0, [request], [])
    assert (book.by_seq, worker.reserved_kv_tokens, len(book.waiting)) == ({"s1": request}, 12, 0)
    assert book.vtc.counter("a") == 5.0 and book.counts.admitted == 1
    request.output.extend([8, 9])
    book.preempt(worker, request)
    assert (request.phase, request.seq_id, request.resumed, worker.pending) == (Phase.PENDING, None, True, [request])
    again = book.admit(worker, request, "s2", now=9.0)
    assert again.output_token_ids == (8, 9)
    assert (request.queue_wait_s, book.vtc.counter("a"), book.counts.admitted) == (2.0, 5.0, 1)
    assert book.by_seq == {"s2": request} and worker.reserved_kv_tokens == 12


def test_detach_frees_in_the_plan_being_built_or_in_the_next_step() -> None:
    book, worker = _book(), make_worker()
    first, second = make_request(1), make_request(2)
    for request in (first, second):
        book.add(worker, request)
        book.admit(worker, request, f"s{request.arrival_order}", now=0.0)
    first.num_computed = second.num_computed = 6       # 2 blocks of 4 each
    plan = StepBuilder(step_id=1, available_blocks=0, token_budget=10, frees=[])
    plan.add("s1", 2, 0, is_decode=True)
    book.preempt(worker, first, plan)
    assert (plan.frees, plan.available_blocks, plan.token_budget, plan.has_work) == (["s1"], 2, 10, False)
    book.activate(worker, second)
    book.detach(worker, second)
    assert (worker.frees, worker.releasing_blocks, worker.active, worker.reserved_kv_tokens) == (["s2"], 2, [], 0)
    assert book.by_seq == {} and book.counts.preemptions == 1


def test_finish_and_reject_take_a_request_out_of_every_book() -> None:
    book, worker = _book(), make_worker()
    running, waiting, stranded = make_request(1), make_request(2, client="b"), make_request(3, client="c")
    for request in (running, waiting, stranded):
        book.add(worker, request)
    book.admit(worker, running, "s1", now=4.0)
    running.output.append(5)
    finish = book.finish(worker, running, FinishReason.LENGTH)
    assert (finish.usage.prompt_tokens, finish.usage.completion_tokens, finish.queue_wait_s) == (4, 1, 3.0)
    rejected = book.reject(worker, waiting, Gate.TIMEOUT, "too late")
    assert rejected.rejection is not None and rejected.rejection.gate is Gate.TIMEOUT
    worker.pending.remove(stranded)                    # as failover leaves it: out of the queue, still counted
    book.reject(None, stranded, Gate.NO_WORKER, "gone")
    assert book.requests == {} and book.by_seq == {} and len(book.waiting) == 0 and worker.pending == []
    assert (book.counts.finished, book.counts.rejections) == ({"length": 1}, {"timeout": 1, "no_worker": 1})


def test_the_worker_bans_stop_tokens_only_until_min_tokens() -> None:
    spec = RequestSpec(request_id="r", prompt_token_ids=(1,), max_tokens=9, stop_token_ids=frozenset({7, 3}))
    plain = make_request(1)
    plain.spec = spec
    assert worker_sampling(plain) is spec.sampling
    plain.spec = RequestSpec(request_id="r", prompt_token_ids=(1,), max_tokens=9, min_tokens=2,
                             stop_token_ids=frozenset({7, 3}), sampling=SamplingParams(temperature=0.5))
    sampling = worker_sampling(plain)
    assert (sampling.min_tokens, sampling.stop_token_ids, sampling.temperature) == (2, (3, 7), 0.5)
