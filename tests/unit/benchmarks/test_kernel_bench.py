"""The kernel benchmark's quick mode times every kernel against its reference and prints its table."""

from __future__ import annotations

import pytest

from benchmarks import kernel_bench


def test_quick_run_prints_every_kernel(capsys: pytest.CaptureFixture[str]) -> None:
    kernel_bench.main(["--quick"])
    out = capsys.readouterr().out
    assert "| kernel | ours (ms) | reference (ms) | reference / ours |" in out
    rows = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith(("| kernel", "|---"))]
    names = " ".join(rows)
    assert len(rows) == 18
    for kernel in ("linears", "weight codes", "narrow codes", "LM head screen", "decode attention", "prefill attention",
                   "greedy argmax"):
        assert kernel in names
