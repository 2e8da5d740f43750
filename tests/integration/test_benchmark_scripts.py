"""Benchmark scripts in their quick mode, so that they keep working (no timing is checked)."""

from __future__ import annotations

import pytest

from benchmarks import async_scheduling_bench, serving_bench, structured_bench


def test_async_scheduling_bench_quick(capsys: pytest.CaptureFixture[str]) -> None:
    async_scheduling_bench.main(["--quick"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| 1 |") or line.startswith("| 2 |")]
    assert len(rows) == 2 and "| false |" in rows[0] and "| true |" in rows[1]
    assert "async on over off" in out


def test_serving_bench_quick(capsys: pytest.CaptureFixture[str]) -> None:
    serving_bench.main(["--quick", "--env", "SPECULATIVE_TOKENS=2"])
    out = capsys.readouterr().out
    assert "fairserve with SPECULATIVE_TOKENS=2" in out
    rows = [line for line in out.splitlines() if line.startswith("| 1 |") or line.startswith("| 2 |")]
    assert len(rows) == 2 and "| fairserve |" in rows[0] and "| transformers |" in rows[1]
    for row in rows:
        ok, sent = row.split("|")[3].split("/")
        assert int(ok) == int(sent) > 0, row          # every request of both servers succeeded


def test_structured_bench_quick(capsys: pytest.CaptureFixture[str]) -> None:
    structured_bench.main(["--quick"])
    out = capsys.readouterr().out
    assert "| 1 |" in out and "| all |" in out
    assert "finish reasons ['length']" in out    # every constrained stream ran to max_tokens
