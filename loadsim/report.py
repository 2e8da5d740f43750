"""Markdown tables and JSON for summaries and rate sweeps."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from loadsim.stats import Summary


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value * 1000:,.1f}"


def render_summary(summary: Summary, title: str = "") -> str:
    outcomes = ", ".join(f"{name} {count}" for name, count in sorted(summary.outcomes.items())) or "none"
    lines = [title] if title else []
    lines += [
        f"{summary.requests} requests in {summary.duration_s:.1f} s ({outcomes}); "
        f"{summary.request_rate:.2f} ok requests/s, {summary.output_tokens_per_s:.1f} output tokens/s, "
        f"{summary.prompt_tokens_per_s:.1f} prompt tokens/s, "
        f"{summary.cached_prompt_fraction:.0%} of prompt tokens from the prefix cache.",
        "",
        "| ms | n | mean | p50 | p90 | p99 | max |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, dist in (("time to first token", summary.ttft_s), ("time per output token", summary.tpot_s),
                       ("inter-chunk latency", summary.itl_s), ("request latency", summary.latency_s)):
        lines.append(f"| {name} | {dist.count} | {_ms(dist.mean)} | {_ms(dist.p50)} | {_ms(dist.p90)} | "
                     f"{_ms(dist.p99)} | {_ms(dist.max)} |")
    return "\n".join(lines)


def render_sweep(rows: Sequence[tuple[float, Summary]]) -> str:
    lines = ["| offered req/s | ok req/s | output tok/s | ok | rejected | other errors | "
             "TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | latency p50 ms | latency p99 ms |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for rate, s in rows:
        ok = s.outcomes.get("ok", 0)
        rejected = s.outcomes.get("rejected", 0)
        other = s.requests - ok - rejected - s.outcomes.get("disconnected", 0)
        lines.append(f"| {rate:g} | {s.request_rate:.2f} | {s.output_tokens_per_s:.1f} | {ok} | {rejected} | "
                     f"{other} | {_ms(s.ttft_s.p50)} | {_ms(s.ttft_s.p99)} | {_ms(s.tpot_s.p50)} | "
                     f"{_ms(s.tpot_s.p99)} | {_ms(s.latency_s.p50)} | {_ms(s.latency_s.p99)} |")
    return "\n".join(lines)


def summary_json(summary: Summary) -> dict[str, Any]:
    return dataclasses.asdict(summary)
