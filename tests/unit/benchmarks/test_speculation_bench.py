"""The speculation benchmark's quick mode runs both modes on a tiny model and prints its table."""

from __future__ import annotations

import pytest

from benchmarks import speculation_bench


def test_quick_run_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    speculation_bench.main(["--quick"])
    out = capsys.readouterr().out
    assert "| prompts | batch | decode tok/s, plain | with speculation | speedup | drafts kept |" in out
    rows = [line for line in out.splitlines() if line.startswith(("| random ids", "| built-in texts"))]
    assert len(rows) == 4
