"""The engine benchmark's quick mode on a tiny model: every row of the table, and with
rounds, the medians over engine and transformers runs that alternate."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import engine_bench
from tests.fixtures.tiny_model import save_tiny_model


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("engine-bench") / "tiny")


def test_quick_run_with_rounds_prints_medians_and_each_round(tiny_model_dir: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    engine_bench.main(["--quick", "--model-dir", str(tiny_model_dir), "--rounds", "3", "--threads", "1"])
    out = capsys.readouterr().out
    assert "median of 3 round(s), engine and transformers alternating" in out
    assert "Prompt tokens the end-to-end runs took from the prefix cache:" in out
    table = [line for line in out.splitlines() if line.startswith("| end-to-end")]
    assert len(table) == 2 and all("—" not in line for line in table)
    rounds = [line for line in out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [line.split(" | ")[0] for line in rounds] == ["| 1", "| 2", "| 3"]
    memory = [line for line in out.splitlines() if line.startswith("| engine process resident MB")]
    assert len(memory) == 1 and float(memory[0].split(" | ")[1].replace(",", "")) > 50


def test_the_pool_size_is_reported(tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    engine_bench.main(["--quick", "--model-dir", str(tiny_model_dir), "--skip-transformers",
                       "--num-blocks", "64", "--threads", "1"])
    assert "| engine process resident MB (64-block KV pool" in capsys.readouterr().out


def test_medians_skip_missing_values() -> None:
    assert engine_bench._median([3.0, 1.0, 2.0]) == 2.0
    assert engine_bench._median([4.0, None, 1.0]) == 2.5
    assert engine_bench._median([None]) is None


def test_rounds_must_be_positive(tiny_model_dir: Path) -> None:
    with pytest.raises(SystemExit):
        engine_bench.main(["--quick", "--model-dir", str(tiny_model_dir), "--rounds", "0"])
