"""The shared-cores benchmark's table (benchmarks/contention_bench.py): TPOT per condition and
policy, each against the same policy idle, and the threads each run ended on."""

from __future__ import annotations

from benchmarks.contention_bench import render


def run(mean_ms: float, threads: int) -> dict:
    return {"mean_ms": mean_ms, "p50_ms": mean_ms, "threads_end": threads, "changes": 0}


def test_each_condition_is_quoted_against_the_same_policy_idle() -> None:
    results = {"idle": {"before": [run(12.0, 2), run(13.0, 2), run(11.0, 2)], "now": [run(12.0, 2)]},
               "busy process": {"before": [run(360.0, 2)], "now": [run(24.0, 1)]},
               "quota 1 CPU": {"before": [], "now": []}}
    lines = render(results).splitlines()
    assert "| idle | before | 12.0 | 1.00x | 2/2/2 | 12.0 / 13.0 / 11.0 |" in lines
    assert "| busy process | before | 360.0 | 30.00x | 2 | 360.0 |" in lines
    assert "| busy process | now | 24.0 | 2.00x | 1 | 24.0 |" in lines
    assert not any(line.startswith("| quota") for line in lines)     # a condition that did not run
