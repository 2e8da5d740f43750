"""From request records to the numbers `vllm bench serve` reports (output
tokens/s, TTFT and TPOT p50/p99, goodput under stated SLOs) with the system's
resident memory during the point (peak and closing, per service), the JSON results
and the markdown tables."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from benchmarks.head_to_head.resident import render_services
from benchmarks.head_to_head.sweep import PointRun
from loadsim.stats import summarize
from loadsim.transport import OK


@dataclass(frozen=True)
class Slo:
    ttft_s: float = 3.0
    tpot_s: float = 0.25

    def describe(self) -> str:
        return f"TTFT ≤ {self.ttft_s * 1000:,.0f} ms and TPOT ≤ {self.tpot_s * 1000:,.0f} ms"


@dataclass(frozen=True)
class Point:
    system: str
    kind: str
    x: float
    sent: int
    ok: int
    duration_s: float
    output_tokens_per_s: float
    requests_per_s: float
    goodput_per_s: float                # ok requests within both SLOs, per second
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    tpot_p50_ms: float | None
    tpot_p99_ms: float | None
    mean_output_tokens: float
    mean_prompt_tokens: float           # as the server counted them (its tokenizer, BOS included or not)
    wrong_length: int                   # ok requests whose reported completion_tokens != max_tokens
    cached_prompt_fraction: float       # what the server says it served from its prefix cache
    errors: tuple[str, ...]
    resident_peak_total_mb: float | None = None       # highest sum over the services of one reading
    resident_peak_mb: dict[str, float] = field(default_factory=dict)   # per service, during the point
    resident_end_mb: dict[str, float] = field(default_factory=dict)    # per service, as the point ended
    round_tokens_per_s: tuple[float, ...] = ()     # every round's output tok/s (rounds.py), in run order


def _ms(value: float | None) -> float | None:
    return None if value is None else value * 1000


def point(system: str, run: PointRun, slo: Slo) -> Point:
    summary = summarize(run.records, run.duration_s)
    ok = [(r, want) for r, want in zip(run.records, run.expected_tokens) if r.outcome == OK]
    good = 0
    for record, _ in ok:
        tpot = ((record.latency_s - record.ttft_s) / (record.completion_tokens - 1)
                if record.ttft_s is not None and record.completion_tokens > 1 else 0.0)
        good += record.ttft_s is not None and record.ttft_s <= slo.ttft_s and tpot <= slo.tpot_s
    errors = Counter(f"{r.outcome}: {r.error[:120]}" for r in run.records if r.outcome != OK)
    duration = max(run.duration_s, 1e-9)
    resident = run.resident
    return Point(
        system=system, kind=run.kind, x=run.x, sent=len(run.records), ok=len(ok), duration_s=run.duration_s,
        output_tokens_per_s=summary.output_tokens_per_s, requests_per_s=len(ok) / duration,
        goodput_per_s=good / duration, ttft_p50_ms=_ms(summary.ttft_s.p50), ttft_p99_ms=_ms(summary.ttft_s.p99),
        tpot_p50_ms=_ms(summary.tpot_s.p50), tpot_p99_ms=_ms(summary.tpot_s.p99),
        mean_output_tokens=sum(r.completion_tokens for r, _ in ok) / len(ok) if ok else 0.0,
        mean_prompt_tokens=sum(r.prompt_tokens for r, _ in ok) / len(ok) if ok else 0.0,
        wrong_length=sum(r.completion_tokens != want for r, want in ok),
        cached_prompt_fraction=summary.cached_prompt_fraction,
        errors=tuple(f"{count}x {text}" for text, count in errors.most_common(3)),
        resident_peak_total_mb=resident.peak_total_mb if resident else None,
        resident_peak_mb=dict(resident.peak_mb) if resident else {},
        resident_end_mb=dict(resident.end_mb) if resident else {})


def to_json(points: list[Point], skipped: dict[str, str], meta: dict[str, Any]) -> dict[str, Any]:
    return {"meta": meta, "skipped": skipped, "points": [asdict(p) for p in points]}


def _num(value: float | None, digits: int = 0) -> str:
    return "—" if value is None else f"{value:,.{digits}f}"


def _tpot(value: float | None) -> str:
    """A TPOT: two decimals under 100 ms, where one stream's ratio against another is read."""
    return _num(value, 2 if value is not None and value < 100 else 0)


def _x(kind: str, x: float) -> str:
    return {"concurrency": f"{x:g} in flight", "rate": f"{x:g} req/s", "chat": f"chat, {x:g} users"}[kind]


def table(points: list[Point], systems: list[str]) -> str:
    """One row per point and system, points in sweep order, systems in run order; the
    resident-memory columns: the peak of all services together during the point, and
    each service's peak."""
    lines = ["| load | system | ok / sent | output tok/s | goodput req/s | TTFT p50 ms | TTFT p99 ms | "
             "TPOT p50 ms | TPOT p99 ms | tokens/req | prefix-cached | peak resident MB | "
             "peak resident MB per service |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    keys = list(dict.fromkeys((p.kind, p.x) for p in points))
    for kind, x in keys:
        for system in systems:
            for p in (p for p in points if p.system == system and (p.kind, p.x) == (kind, x)):
                tokens = _num(p.mean_output_tokens, 1) + (f" ({p.wrong_length} off)" if p.wrong_length else "")
                lines.append(
                    f"| {_x(kind, x)} | {system} | {p.ok} / {p.sent} | {_num(p.output_tokens_per_s, 1)} | "
                    f"{_num(p.goodput_per_s, 2)} | {_num(p.ttft_p50_ms)} | {_num(p.ttft_p99_ms)} | "
                    f"{_tpot(p.tpot_p50_ms)} | {_tpot(p.tpot_p99_ms)} | {tokens} | "
                    f"{p.cached_prompt_fraction:.0%} | {_num(p.resident_peak_total_mb)} | "
                    f"{render_services(p.resident_peak_mb)} |")
    return "\n".join(lines)


def problems(points: list[Point]) -> list[str]:
    """Lines for failed requests and answers of the wrong length, per point."""
    lines = []
    for p in points:
        for error in p.errors:
            lines.append(f"{p.system} at {_x(p.kind, p.x)}: {error}")
        if p.wrong_length:
            lines.append(f"{p.system} at {_x(p.kind, p.x)}: {p.wrong_length} of {p.ok} answers were not "
                         f"max_tokens long (mean {p.mean_output_tokens:.1f})")
    return lines
