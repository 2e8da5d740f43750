"""Request latency and throughput over a sliding time window.

The gateway records one RequestRecord per finished request; snapshot() gives
p50/p95/p99 of each latency over the last window_s seconds, token rates over
the same window, totals since start and per-session counts, as a JSON-able
dict (the "gateway" part of /stats, see docs/metrics.md).

Pure: no web or gRPC imports, and the clock is injected. Memory is bounded:
each latency keeps at most max_samples recent samples, token rates live in
one-second buckets, and at most max_sessions sessions are remembered (the
least recently seen is forgotten first).
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

Clock = Callable[[], float]

QUANTILES = (50, 95, 99)
LATENCIES = ("ttft", "tpot", "itl", "e2e", "queue_wait")


@dataclass(frozen=True)
class RequestRecord:
    """What one finished request measured, latencies in seconds."""

    session_id: str
    input_tokens: int
    output_tokens: int
    e2e_s: float
    ttft_s: float | None = None  # None: the request produced no token
    queue_wait_s: float | None = None  # None: not reported for this request
    inter_token_s: tuple[float, ...] = ()  # each gap between consecutive tokens
    finish_reason: str = "stop"

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first one."""
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The q-th percentile with linear interpolation between closest ranks
    (numpy's default method); sorted_values must be sorted and non-empty."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    rank = (len(sorted_values) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(sorted_values) - 1)
    fraction = rank - low
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * fraction


def summarize_ms(values_s: Iterable[float]) -> dict[str, float | int | None]:
    """count, mean and the QUANTILES of latencies given in seconds, in ms;
    the statistics are None when there are no values."""
    ordered = sorted(v * 1000.0 for v in values_s)
    summary: dict[str, float | int | None] = {"count": len(ordered)}
    summary["mean"] = sum(ordered) / len(ordered) if ordered else None
    for q in QUANTILES:
        summary[f"p{q}"] = percentile(ordered, q) if ordered else None
    return summary


class _SampleWindow:
    """(time, value) samples, the most recent max_samples at most."""

    def __init__(self, max_samples: int) -> None:
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)

    def add(self, at: float, value: float) -> None:
        self._samples.append((at, value))

    def expire(self, cutoff: float) -> None:
        while self._samples and self._samples[0][0] < cutoff:
            self._samples.popleft()

    def values(self) -> list[float]:
        return [value for _, value in self._samples]


@dataclass
class _Bucket:
    start: float
    requests: int = 0
    input_tokens: int = 0
    output_tokens: int = 0


class _RateWindow:
    """Request and token counts in buckets of bucket_s seconds; a bucket
    leaves the window once it started before the cutoff."""

    def __init__(self, bucket_s: float) -> None:
        self._bucket_s = bucket_s
        self._buckets: deque[_Bucket] = deque()

    def add(self, at: float, input_tokens: int, output_tokens: int) -> None:
        start = math.floor(at / self._bucket_s) * self._bucket_s
        if not self._buckets or self._buckets[-1].start < start:
            self._buckets.append(_Bucket(start))
        bucket = self._buckets[-1]
        bucket.requests += 1
        bucket.input_tokens += input_tokens
        bucket.output_tokens += output_tokens

    def expire(self, cutoff: float) -> None:
        while self._buckets and self._buckets[0].start < cutoff:
            self._buckets.popleft()

    def sums(self) -> tuple[int, int, int]:
        return (sum(b.requests for b in self._buckets),
                sum(b.input_tokens for b in self._buckets),
                sum(b.output_tokens for b in self._buckets))


@dataclass
class _SessionCounts:
    requests: int = 0
    input_tokens: int = 0
    output_tokens: int = 0


class LatencyTracker:
    """Thread-safe; record() and snapshot() are O(max_samples) at worst."""

    def __init__(self, window_s: float = 60.0, clock: Clock = time.monotonic,
                 max_samples: int = 5000, max_sessions: int = 1000,
                 sessions_reported: int = 32, bucket_s: float = 1.0) -> None:
        if window_s <= 0 or max_samples <= 0 or max_sessions <= 0 or bucket_s <= 0:
            raise ValueError("window_s, max_samples, max_sessions and bucket_s must be positive")
        self.window_s = window_s
        self._clock = clock
        self._bucket_s = bucket_s
        self._sessions_reported = sessions_reported
        self._max_sessions = max_sessions
        self._started = clock()
        self._lock = threading.Lock()
        self._latencies = {name: _SampleWindow(max_samples) for name in LATENCIES}
        self._rates = _RateWindow(bucket_s)
        self._sessions: OrderedDict[str, _SessionCounts] = OrderedDict()
        self._total_requests = 0
        self._total_input_tokens = 0
        self._total_output_tokens = 0
        self._finish_reasons: dict[str, int] = {}

    def record(self, request: RequestRecord) -> None:
        now = self._clock()
        with self._lock:
            self._add_latencies(now, request)
            self._rates.add(now, request.input_tokens, request.output_tokens)
            self._count_session(request)
            self._total_requests += 1
            self._total_input_tokens += request.input_tokens
            self._total_output_tokens += request.output_tokens
            reason = request.finish_reason
            self._finish_reasons[reason] = self._finish_reasons.get(reason, 0) + 1
            self._expire(now)

    def _add_latencies(self, now: float, request: RequestRecord) -> None:
        singles = {"ttft": request.ttft_s, "tpot": request.tpot_s, "e2e": request.e2e_s,
                   "queue_wait": request.queue_wait_s}
        for name, value in singles.items():
            if value is not None:
                self._latencies[name].add(now, value)
        for gap in request.inter_token_s:
            self._latencies["itl"].add(now, gap)

    def _count_session(self, request: RequestRecord) -> None:
        counts = self._sessions.get(request.session_id)
        if counts is None:
            counts = self._sessions[request.session_id] = _SessionCounts()
            if len(self._sessions) > self._max_sessions:
                self._sessions.popitem(last=False)
        else:
            self._sessions.move_to_end(request.session_id)
        counts.requests += 1
        counts.input_tokens += request.input_tokens
        counts.output_tokens += request.output_tokens

    def _expire(self, now: float) -> None:
        cutoff = now - self.window_s
        for samples in self._latencies.values():
            samples.expire(cutoff)
        self._rates.expire(cutoff)

    def snapshot(self) -> dict:
        now = self._clock()
        with self._lock:
            self._expire(now)
            latencies = {name: samples.values() for name, samples in self._latencies.items()}
            requests, input_tokens, output_tokens = self._rates.sums()
            sessions = [(sid, c.requests, c.input_tokens, c.output_tokens)
                        for sid, c in self._sessions.items()]
            totals = {"requests": self._total_requests, "input_tokens": self._total_input_tokens,
                      "output_tokens": self._total_output_tokens,
                      "finish_reasons": dict(self._finish_reasons)}
        uptime = now - self._started
        # Before a full window has passed, rates divide by the time elapsed
        # (at least one bucket, so the first requests do not read as a spike).
        span = min(self.window_s, max(uptime, self._bucket_s))
        sessions.sort(key=lambda s: (-s[3], s[0]))
        return {
            "window_s": self.window_s,
            "uptime_s": uptime,
            "latency_ms": {name: summarize_ms(values) for name, values in latencies.items()},
            "window": {
                "requests": requests, "input_tokens": input_tokens, "output_tokens": output_tokens,
                "requests_per_s": requests / span, "input_tokens_per_s": input_tokens / span,
                "output_tokens_per_s": output_tokens / span,
            },
            "totals": totals,
            "sessions_tracked": len(sessions),
            "sessions": [{"session_id": sid, "requests": n, "input_tokens": tin, "output_tokens": tout}
                         for sid, n, tin, tout in sessions[:self._sessions_reported]],
        }
