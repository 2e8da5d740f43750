"""The code-width benchmark on a tiny model: both engines measured and the same greedy tokens."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from benchmarks import code_width_bench
from tests.fixtures.tiny_model import save_tiny_model


def test_a_short_run_prints_both_modes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model_dir = save_tiny_model(tmp_path / "tiny")
    code_width_bench.main(["--model-dir", str(model_dir), "--rounds", "1", "--steps", "2", "--batches", "1,2"])
    out = capsys.readouterr().out
    assert "same greedy tokens: yes" in out
    assert re.search(r"auto's calibration: .*picks (narrow|8-bit) codes\.", out)
    assert "| CPU_WEIGHT_CODES | linears | codes MB | decode tok/s @ 1 | decode tok/s @ 2 |" in out
    rows = [line for line in out.splitlines() if line.startswith(("| narrow", "| 8bit"))]
    assert len(rows) == 2
