"""Aggregates request records into the numbers a serving benchmark reports."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from loadsim.transport import DISCONNECTED, OK, RequestRecord


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0-100), linear between the closest ranks; None when empty."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within 0..100, not {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True)
class Distribution:
    count: int
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None
    max: float | None

    @classmethod
    def of(cls, values: Sequence[float]) -> "Distribution":
        return cls(count=len(values), mean=sum(values) / len(values) if values else None,
                   p50=percentile(values, 50), p90=percentile(values, 90), p99=percentile(values, 99),
                   max=max(values) if values else None)


@dataclass(frozen=True)
class Summary:
    duration_s: float
    requests: int
    outcomes: dict[str, int]
    request_rate: float                 # completed (ok) requests per second
    output_tokens_per_s: float          # over ok and deliberately disconnected requests
    prompt_tokens_per_s: float
    cached_prompt_fraction: float       # prompt tokens served from the prefix cache
    ttft_s: Distribution
    tpot_s: Distribution                # per ok request: (latency - ttft) / (completion tokens - 1)
    itl_s: Distribution                 # gaps between consecutive streamed chunks
    latency_s: Distribution             # ok requests, whole stream


def summarize(records: Sequence[RequestRecord], duration_s: float) -> Summary:
    ok = [r for r in records if r.outcome == OK]
    served = [r for r in records if r.outcome in (OK, DISCONNECTED)]
    tpot = [(r.latency_s - r.ttft_s) / (r.completion_tokens - 1)
            for r in ok if r.ttft_s is not None and r.completion_tokens > 1]
    itl = [later - earlier for r in served for earlier, later in zip(r.chunk_times_s, r.chunk_times_s[1:])]
    prompt_tokens = sum(r.prompt_tokens for r in served)
    duration = max(duration_s, 1e-9)
    return Summary(
        duration_s=duration_s, requests=len(records), outcomes=dict(Counter(r.outcome for r in records)),
        request_rate=len(ok) / duration,
        output_tokens_per_s=sum(r.completion_tokens for r in served) / duration,
        prompt_tokens_per_s=prompt_tokens / duration,
        cached_prompt_fraction=sum(r.cached_tokens for r in served) / prompt_tokens if prompt_tokens else 0.0,
        ttft_s=Distribution.of([r.ttft_s for r in served if r.ttft_s is not None]),
        tpot_s=Distribution.of(tpot), itl_s=Distribution.of(itl),
        latency_s=Distribution.of([r.latency_s for r in ok]))
