"""MAX_MIGRATIONS: a request running on workers that keep failing (one that
crashes them) moves at most that many times, then ends with an error."""

from __future__ import annotations

from services.scheduler.core.types import CoreConfig, FinishReason
from services.scheduler.core.fairness.counters import CoreCounters
from services.scheduler.core.faults.failover import Failover
from services.scheduler.core.fairness.vtc import VirtualTokenCounter
from services.scheduler.core.request_book import RequestBook
from services.scheduler.core.routing import SessionMap

from tests.unit.scheduler.fake_worker import FakeEngine, reference_output
from tests.unit.scheduler.harness import Harness
from tests.unit.scheduler.plain_state import make_request, make_worker

PROMPT = tuple(range(30, 42))


def _workers(count: int, **config: object) -> Harness:
    engines = {f"w{index}": FakeEngine() for index in range(count)}
    return Harness(CoreConfig(max_batch_size=4, **config), engines)  # type: ignore[arg-type]


def _fail_where_it_runs(h: Harness, request_id: str) -> str:
    """Steps until the request has made a token on its worker (it runs there), then fails
    that worker."""
    seen = len(h.streams[request_id].tokens)
    while len(h.streams[request_id].tokens) <= seen:
        h.step()
    worker_id = h.core.worker_of(request_id)
    assert worker_id is not None
    h.deliver(h.core.remove_worker(worker_id, f"worker {worker_id} failed a step"))
    return worker_id


def test_a_request_failing_over_past_the_limit_ends_with_an_error() -> None:
    h = _workers(4, max_migrations=2)
    request_id = h.submit(PROMPT, max_tokens=200).request_id
    for _ in range(2):
        _fail_where_it_runs(h, request_id)
        assert h.streams[request_id].finish is None       # moved on, resumed elsewhere
    seen = len(h.streams[request_id].tokens)
    _fail_where_it_runs(h, request_id)
    finish = h.streams[request_id].finish
    assert finish is not None and finish.reason is FinishReason.ERROR
    assert "MAX_MIGRATIONS=2" in finish.message and "3 workers" in finish.message
    assert len(h.streams[request_id].tokens) >= seen
    assert h.core.stats().migrations == 2
    assert len(h.core.worker_ids()) == 1 and h.core.worker_of(request_id) is None


def test_zero_means_a_running_request_never_moves_but_waiting_ones_still_do() -> None:
    h = _workers(2, max_migrations=0)
    running = h.submit(PROMPT, max_tokens=50, hints={"w0": 12}).request_id
    h.step()
    waiting = h.submit(PROMPT[::-1], max_tokens=3, hints={"w0": 12}).request_id
    assert h.core.worker_of(waiting) == "w0"
    h.deliver(h.core.remove_worker("w0", "w0 crashed"))
    finish = h.streams[running].finish
    assert finish is not None and finish.reason is FinishReason.ERROR and "MAX_MIGRATIONS=0" in finish.message
    h.run()
    assert h.streams[waiting].token_ids == reference_output(PROMPT[::-1], 3)


def test_the_other_requests_of_a_failing_worker_have_their_own_counts() -> None:
    h = _workers(3, max_migrations=1)
    poison = h.submit(PROMPT, max_tokens=100, hints={"w0": 12}).request_id
    bystander = h.submit(PROMPT[1:], max_tokens=20, hints={"w0": 12}).request_id
    h.step()
    h.deliver(h.core.remove_worker("w0", "w0 crashed"))   # both move, to different workers
    assert h.core.worker_of(poison) != h.core.worker_of(bystander)
    _fail_where_it_runs(h, poison)                          # the poison's second failure: it ends
    assert h.streams[poison].finish is not None and h.streams[poison].finish.reason is FinishReason.ERROR
    h.run()
    finish = h.streams[bystander].finish
    assert finish is not None and finish.reason is FinishReason.LENGTH
    assert h.streams[bystander].token_ids == reference_output(PROMPT[1:], 20)


def test_a_restarted_worker_counts_as_a_failure_of_what_ran_there() -> None:
    h = _workers(2, max_migrations=1)
    request_id = h.submit(PROMPT, max_tokens=100, hints={"w0": 12}).request_id
    h.step()
    h.deliver(h.core.add_worker(h.engines["w0"].spec("w0")))    # w0 came back empty
    assert h.streams[request_id].finish is None
    _fail_where_it_runs(h, request_id)
    finish = h.streams[request_id].finish
    assert finish is not None and "MAX_MIGRATIONS=1" in finish.message


def test_moves_of_a_worker_leaving_on_purpose_do_not_count() -> None:
    book = RequestBook(VirtualTokenCounter(input_weight=1.0, output_weight=2.0), CoreCounters())
    failover = Failover(book, SessionMap(), 1000, max_migrations=0)
    leaving = make_worker("w0")
    request = make_request(1)
    book.add(leaving, request)
    book.admit(leaving, request, "s1", now=5.0)
    assert failover.rehome(failover.release(leaving), [make_worker("w1")], "w0 is draining") == []
    assert request.failovers == 0 and request.worker_id == "w1"
