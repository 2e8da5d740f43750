"""make bench-bf16's script: the agreement measure, and its quick mode (tiny random model)
end to end where the CPU has BF16 instructions."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks.bf16_bench import agreement, main
from services.worker.engine.cpu.linear.bf16_compute import BF16_CPU_FLAGS, cpu_flags
from services.worker.engine.cpu.linear.cpu_linear import onednn_bf16_packing_available


def test_agreement_counts_positions_whole_sequences_and_common_prefixes() -> None:
    reference = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]]
    other = [[1, 2, 3, 4], [5, 6, 0, 8], [0, 9, 9, 9]]
    got = agreement(reference, other)
    assert got.tokens == pytest.approx(10 / 12)
    assert got.sequences == pytest.approx(1 / 3)
    assert got.mean_prefix == pytest.approx((4 + 2 + 0) / 3)
    with pytest.raises(ValueError):
        agreement(reference, other[:2])


@pytest.mark.skipif(not (cpu_flags() & set(BF16_CPU_FLAGS) and onednn_bf16_packing_available()),
                    reason="this CPU has no BF16 instructions (avx512_bf16 / amx_bf16)")
def test_quick_mode_reports_both_modes(tmp_path: Path, capsys) -> None:
    main(["--quick", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "results.json").read_text())
    assert set(report["speed"]) == {"float32", "bfloat16"}
    assert set(report["speed"]["float32"]) == {"prefill", "decode@1", "decode@4"}
    assert all(value > 0 for mode in report["speed"].values() for value in mode.values())
    assert all(math.isfinite(value) and value > 1 for value in report["perplexity"].values())
    assert 0 <= report["agreement"]["tokens"] <= 1
    assert "| perplexity, 300 tokens of Python docs |" in capsys.readouterr().out
