import json
import random

import numpy as np
import pytest

from services.gateway.observability.latency_tracker import LatencyTracker, RequestRecord, percentile, summarize_ms


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def request(session: str = "s", input_tokens: int = 10, output_tokens: int = 5, e2e: float = 1.0,
            ttft: float | None = 0.2, queue_wait: float | None = 0.05,
            gaps: tuple[float, ...] = (), finish_reason: str = "stop") -> RequestRecord:
    return RequestRecord(session_id=session, input_tokens=input_tokens, output_tokens=output_tokens,
                         e2e_s=e2e, ttft_s=ttft, queue_wait_s=queue_wait, inter_token_s=gaps,
                         finish_reason=finish_reason)


@pytest.mark.parametrize("n", [1, 2, 3, 10, 101, 1000])
def test_percentile_matches_numpy(n):
    rng = random.Random(n)
    values = sorted(rng.expovariate(3.0) for _ in range(n))
    for q in (0, 1, 50, 95, 99, 99.9, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-12, abs=1e-15)


def test_percentile_of_nothing_is_an_error():
    with pytest.raises(ValueError):
        percentile([], 50)


def test_summary_is_in_milliseconds_and_none_when_empty():
    assert summarize_ms([]) == {"count": 0, "mean": None, "p50": None, "p95": None, "p99": None}
    summary = summarize_ms([0.3, 0.1, 0.2])
    assert summary["count"] == 3
    assert summary["mean"] == pytest.approx(200.0)
    assert summary["p50"] == pytest.approx(200.0)


def test_tpot_excludes_the_first_token():
    assert request(output_tokens=5, e2e=1.0, ttft=0.2).tpot_s == pytest.approx(0.2)
    assert request(output_tokens=1).tpot_s is None
    assert request(ttft=None).tpot_s is None


def test_snapshot_percentiles_match_numpy_on_known_data():
    clock = FakeClock()
    tracker = LatencyTracker(clock=clock)
    rng = random.Random(7)
    ttfts, tpots, e2es, waits, gaps_all = [], [], [], [], []
    for i in range(200):
        ttft = rng.uniform(0.01, 2.0)
        out = rng.randint(2, 40)
        e2e = ttft + rng.uniform(0.0, 3.0)
        wait = rng.uniform(0.0, 0.5)
        gaps = tuple(rng.uniform(0.001, 0.2) for _ in range(out - 1))
        tracker.record(request(session=f"s{i % 3}", output_tokens=out, e2e=e2e, ttft=ttft,
                               queue_wait=wait, gaps=gaps))
        ttfts.append(ttft)
        tpots.append((e2e - ttft) / (out - 1))
        e2es.append(e2e)
        waits.append(wait)
        gaps_all.extend(gaps)
        clock.advance(0.1)
    latency = tracker.snapshot()["latency_ms"]
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("e2e", e2es), ("queue_wait", waits),
                         ("itl", gaps_all)):
        expected_ms = np.array(values) * 1000.0
        assert latency[name]["count"] == len(values)
        assert latency[name]["mean"] == pytest.approx(float(expected_ms.mean()))
        for q in (50, 95, 99):
            assert latency[name][f"p{q}"] == pytest.approx(float(np.percentile(expected_ms, q))), (name, q)


def test_samples_leave_the_window():
    clock = FakeClock()
    tracker = LatencyTracker(window_s=60.0, clock=clock)
    tracker.record(request(ttft=5.0, e2e=6.0))
    clock.advance(30)
    tracker.record(request(ttft=1.0, e2e=2.0))
    latency = tracker.snapshot()["latency_ms"]
    assert latency["ttft"]["count"] == 2
    clock.advance(30.5)  # the first request is now 60.5 s old
    latency = tracker.snapshot()["latency_ms"]
    assert latency["ttft"]["count"] == 1
    assert latency["ttft"]["p99"] == pytest.approx(1000.0)
    clock.advance(30)
    snapshot = tracker.snapshot()
    assert snapshot["latency_ms"]["ttft"]["count"] == 0
    assert snapshot["latency_ms"]["ttft"]["p50"] is None
    assert snapshot["window"]["requests"] == 0
    assert snapshot["window"]["output_tokens_per_s"] == 0
    assert snapshot["totals"]["requests"] == 2  # totals never expire


def test_token_rates_over_the_window():
    clock = FakeClock(0.0)
    tracker = LatencyTracker(window_s=10.0, clock=clock)
    clock.advance(2.0)
    tracker.record(request(input_tokens=100, output_tokens=40))
    window = tracker.snapshot()["window"]
    # Only 2 s have passed: rates divide by the elapsed time, not the window.
    assert window["input_tokens_per_s"] == pytest.approx(50.0)
    assert window["output_tokens_per_s"] == pytest.approx(20.0)
    for _ in range(9):
        clock.advance(1.0)
        tracker.record(request(input_tokens=100, output_tokens=40))
    window = tracker.snapshot()["window"]
    assert window["requests"] == 10
    assert window["input_tokens_per_s"] == pytest.approx(100.0)
    assert window["output_tokens_per_s"] == pytest.approx(40.0)
    assert window["requests_per_s"] == pytest.approx(1.0)
    clock.advance(5.5)  # the five oldest requests drop out
    window = tracker.snapshot()["window"]
    assert window["requests"] == 5
    assert window["output_tokens_per_s"] == pytest.approx(20.0)


def test_first_request_is_not_a_rate_spike():
    clock = FakeClock()
    tracker = LatencyTracker(clock=clock)
    clock.advance(0.001)
    tracker.record(request(output_tokens=50))
    assert tracker.snapshot()["window"]["output_tokens_per_s"] == pytest.approx(50.0)


def test_totals_and_finish_reasons():
    clock = FakeClock()
    tracker = LatencyTracker(window_s=1.0, clock=clock)
    tracker.record(request(input_tokens=3, output_tokens=4, finish_reason="stop"))
    clock.advance(5)
    tracker.record(request(input_tokens=5, output_tokens=0, ttft=None, finish_reason="cancelled"))
    tracker.record(request(input_tokens=1, output_tokens=2, finish_reason="stop"))
    totals = tracker.snapshot()["totals"]
    assert totals == {"requests": 3, "input_tokens": 9, "output_tokens": 6,
                      "finish_reasons": {"stop": 2, "cancelled": 1}}


def test_per_session_counts_sorted_by_output_tokens():
    clock = FakeClock()
    tracker = LatencyTracker(clock=clock, sessions_reported=2)
    tracker.record(request(session="a", input_tokens=1, output_tokens=10))
    tracker.record(request(session="b", input_tokens=2, output_tokens=30))
    tracker.record(request(session="a", input_tokens=3, output_tokens=5))
    tracker.record(request(session="c", input_tokens=4, output_tokens=1))
    snapshot = tracker.snapshot()
    assert snapshot["sessions_tracked"] == 3
    assert snapshot["sessions"] == [
        {"session_id": "b", "requests": 1, "input_tokens": 2, "output_tokens": 30},
        {"session_id": "a", "requests": 2, "input_tokens": 4, "output_tokens": 15},
    ]


def test_memory_is_bounded():
    clock = FakeClock()
    tracker = LatencyTracker(clock=clock, max_samples=100, max_sessions=10)
    for i in range(1000):
        tracker.record(request(session=f"s{i}", ttft=float(i), e2e=float(i) + 1, gaps=(0.01,) * 50))
    snapshot = tracker.snapshot()
    assert snapshot["latency_ms"]["ttft"]["count"] == 100
    # The most recent samples are the ones kept.
    assert snapshot["latency_ms"]["ttft"]["p50"] == pytest.approx(949.5 * 1000.0)
    assert snapshot["latency_ms"]["itl"]["count"] == 100
    assert snapshot["sessions_tracked"] == 10
    assert {s["session_id"] for s in snapshot["sessions"]} == {f"s{i}" for i in range(990, 1000)}


def test_recently_seen_session_is_kept_when_the_cap_is_hit():
    clock = FakeClock()
    tracker = LatencyTracker(clock=clock, max_sessions=2)
    tracker.record(request(session="old"))
    tracker.record(request(session="mid"))
    tracker.record(request(session="old"))
    tracker.record(request(session="new"))
    assert {s["session_id"] for s in tracker.snapshot()["sessions"]} == {"old", "new"}


def test_snapshot_is_json_serializable_when_empty_and_full():
    clock = FakeClock()
    tracker = LatencyTracker(clock=clock)
    json.dumps(tracker.snapshot(), allow_nan=False)
    tracker.record(request(gaps=(0.1, 0.2)))
    decoded = json.loads(json.dumps(tracker.snapshot(), allow_nan=False))
    assert set(decoded["latency_ms"]) == {"ttft", "tpot", "itl", "e2e", "queue_wait"}
    assert decoded["latency_ms"]["itl"]["count"] == 2


def test_requests_without_queue_wait_or_tokens_skip_those_latencies():
    clock = FakeClock()
    tracker = LatencyTracker(clock=clock)
    tracker.record(request(ttft=None, queue_wait=None, output_tokens=0, e2e=0.5))
    latency = tracker.snapshot()["latency_ms"]
    assert latency["e2e"]["count"] == 1
    assert latency["ttft"]["count"] == latency["tpot"]["count"] == latency["queue_wait"]["count"] == 0


@pytest.mark.parametrize("kwargs", [{"window_s": 0}, {"max_samples": 0}, {"max_sessions": 0}, {"bucket_s": -1}])
def test_rejects_non_positive_limits(kwargs):
    with pytest.raises(ValueError):
        LatencyTracker(**kwargs)
