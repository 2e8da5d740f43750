"""The kernel benchmark's quick mode times every kernel against its reference and prints its table."""

from __future__ import annotations

import pytest

from benchmarks import kernel_bench
from services.worker.engine.cpu.screen.lm_head_screen import load_native_matmul
from services.worker.engine.cpu.kernels.native_build import default_cache_dir
from services.worker.engine.cpu.linear.prefill_gemm import load_prefill_gemm


def test_quick_run_prints_every_kernel(capsys: pytest.CaptureFixture[str]) -> None:
    kernel_bench.main(["--quick"])
    out = capsys.readouterr().out
    assert "| kernel | ours (ms) | reference (ms) | reference / ours |" in out
    rows = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith(("| kernel", "|---"))]
    names = " ".join(rows)
    native = load_native_matmul(default_cache_dir())
    gemm = load_prefill_gemm(default_cache_dir())
    # the codes screen: int8 vs int16, or int16 alone, and half vs float scales; the prefill GEMM
    # where AVX2 runs it
    assert len(rows) == 18 + (5 if native is not None else 0) + (2 if gemm is not None else 0)
    if gemm is not None:
        assert sum("native prefill GEMM vs oneDNN packed" in row for row in rows) == 2
    if native is not None:
        wanted = "int8 vs int16 activations" if native.has_codes_quads else "int16 activations, "
        assert sum(wanted in row for row in rows) == 3
        assert sum("half vs float scales" in row for row in rows) == 2
    for kernel in ("linears", "weight codes", "narrow codes", "LM head screen", "decode attention", "prefill attention",
                   "greedy argmax"):
        assert kernel in names
