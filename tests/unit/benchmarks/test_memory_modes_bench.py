"""The memory-modes benchmark on a tiny model: every engine measured, resident memory read
from a fresh process each, the same greedy tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import memory_modes_bench
from tests.fixtures.tiny_model import save_tiny_model


def test_a_short_run_prints_every_mode(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model_dir = save_tiny_model(tmp_path / "tiny")
    memory_modes_bench.main(["--model-dir", str(model_dir), "--rounds", "1", "--steps", "2", "--prompt-len", "40"])
    out = capsys.readouterr().out
    assert "same greedy tokens: yes" in out
    rows = [line.split("|") for line in out.splitlines() if line.startswith(("| default", "| copies", "| lean"))]
    assert len(rows) == 3
    assert all(float(row[-2].replace(",", "")) > 50 for row in rows)      # a fresh engine's MB
