"""Percentiles, summaries and their rendering."""

from __future__ import annotations

import pytest

from loadsim.report import render_summary, render_sweep, summary_json
from loadsim.stats import Distribution, percentile, summarize
from loadsim.transport import DISCONNECTED, OK, REJECTED, RequestRecord


def record(outcome: str = OK, ttft: float | None = 0.1, latency: float = 1.0, chunks: list[float] | None = None,
           completion: int = 0, prompt: int = 10, cached: int = 0) -> RequestRecord:
    return RequestRecord(user="u", user_class="c", template="t", started_s=0.0, outcome=outcome, ttft_s=ttft,
                         latency_s=latency, chunk_times_s=chunks or [], prompt_tokens=prompt,
                         completion_tokens=completion, cached_tokens=cached)


def test_percentile_interpolates_like_numpy() -> None:
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert percentile(values, 50) == 2.5 and percentile(values, 90) == pytest.approx(3.7)
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile(values, 101)


def test_summary_counts_tokens_and_latencies() -> None:
    records = [
        record(ttft=0.2, latency=1.2, chunks=[0.2, 0.7, 1.2], completion=3, prompt=100, cached=50),
        record(ttft=0.4, latency=0.4, chunks=[0.4], completion=1, prompt=20),
        record(DISCONNECTED, ttft=0.3, latency=0.3, chunks=[0.3], completion=0, prompt=30),
        record(REJECTED, ttft=None, latency=0.01, prompt=0),
    ]
    summary = summarize(records, duration_s=2.0)
    assert summary.requests == 4 and summary.outcomes == {OK: 2, DISCONNECTED: 1, REJECTED: 1}
    assert summary.request_rate == 1.0
    assert summary.output_tokens_per_s == 2.0 and summary.prompt_tokens_per_s == 75.0
    assert summary.cached_prompt_fraction == pytest.approx(50 / 150)
    assert summary.ttft_s.count == 3 and summary.ttft_s.p50 == pytest.approx(0.3)
    assert summary.tpot_s == Distribution.of([0.5])            # (1.2 - 0.2) / 2
    assert summary.itl_s == Distribution.of([0.5, 0.5])
    assert summary.latency_s.count == 2 and summary.latency_s.max == 1.2


def test_an_empty_run_renders() -> None:
    summary = summarize([], duration_s=0.0)
    assert summary.ttft_s.mean is None and summary.request_rate == 0.0
    assert "0 requests" in render_summary(summary) and "| time to first token | 0 | — |" in render_summary(summary)


def test_tables_and_json() -> None:
    summary = summarize([record(completion=2, chunks=[0.1, 0.3], latency=0.3)], duration_s=1.0)
    text = render_summary(summary, "Title:")
    assert text.startswith("Title:\n1 requests in 1.0 s (ok 1)") and "| time per output token | 1 | 200.0 |" in text
    sweep = render_sweep([(0.5, summary), (2.0, summary)])
    assert sweep.count("\n") == 3 and "| 0.5 | 1.00 | 2.0 | 1 | 0 | 0 | 100.0 |" in sweep
    assert summary_json(summary)["ttft_s"]["p50"] == 0.1
