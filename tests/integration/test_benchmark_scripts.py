"""Benchmark scripts in their quick mode, so that they keep working (no timing is checked)."""

from __future__ import annotations

import pytest

from benchmarks import async_scheduling_bench, isolation_bench, serving_bench, structured_bench


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


def test_isolation_bench_quick(capsys: pytest.CaptureFixture[str]) -> None:
    isolation_bench.main(["--quick", "--flood-kb", "200"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "gap" not in line]
    assert [row.split("|")[1].strip() for row in rows][:2] == ["alone", "200 KB texts"]
    assert "context_length_exceeded" in rows[1]          # past the tiny context: refused by length
    assert "x 200" in rows[2]                             # texts that fit are tokenized
