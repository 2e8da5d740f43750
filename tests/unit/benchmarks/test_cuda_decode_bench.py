"""The CUDA decode benchmark's script, checked on CPU (graphs replay through the
tests' stand-in there): it runs end to end and the two engines agree."""

from __future__ import annotations

import re

import pytest

from benchmarks import cuda_decode_bench


def test_quick_run_on_cpu_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    cuda_decode_bench.main(["--device", "cpu", "--quick"])
    out = capsys.readouterr().out
    rows = re.findall(r"^\| decode tokens/s, batch (\d+), decode graphs \|.*\| (\d+) / (\d+) \|$", out, re.M)
    assert [int(batch) for batch, _, _ in rows] == list(cuda_decode_bench.QUICK.batches)
    for _, agreeing, total in rows:
        assert agreeing == total
    assert re.search(r"^\| graphs captured / replayed steps \| \| \d+ / \d+ \| \| on \|$", out, re.M)
    assert "| prefill tokens/s, 2 prompts in one step, flash-attn varlen |" in out
