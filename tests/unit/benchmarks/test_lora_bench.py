"""The LoRA benchmark's quick mode on a tiny model: a row per configuration, each round's rate."""

from __future__ import annotations

import pytest

from benchmarks import lora_bench


def test_quick_run_prints_every_configuration(capsys: pytest.CaptureFixture[str]) -> None:
    lora_bench.main(["--quick", "--concurrency", "2", "--adapters", "1,3", "--rounds", "2", "--new-tokens", "3"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "tok/s" not in line]
    assert [row.split(" | ")[0] for row in rows] == ["| base only", "| 1 adapter", "| 3 adapters"]
    assert all(len(row.split(" | ")[3].split(" / ")) == 2 for row in rows)
