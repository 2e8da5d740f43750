"""ctypes binding of native/prefill_gemm.c, a float32 GEMM for wide steps (AVX2, FMA), and
the start-up check that decides, per weight shape, whether it serves (CPU_PREFILL_GEMM).

The kernel multiplies a weight laid out in panels of 16 output columns, which coded_wide.py
writes straight from a linear's codes. Under `auto` it serves a shape only where its outputs
equal the GEMM it replaces bit for bit on probes of several row counts (so the tokens do not
change) and a short calibration runs it faster; `native` takes it wherever it runs; `library`
and `amx` (the AMX GEMM wherever it runs, amx_gemm.py) never.
"""

from __future__ import annotations

import ctypes
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from services.worker.engine.cpu.kernels.native_build import load_binding

PANEL = 16                       # output columns a panel of the kernel's weight layout
MODES = ("auto", "native", "amx", "library")   # amx: amx_gemm.py
PROBE_ROWS = (7, 40, 300)        # row counts whose outputs must match bit for bit (tiles, blocks, threads)
CALIBRATION_ROWS = 1024          # a prefill step's rows: at 256 the two GEMMs were even on AVX2
CALIBRATION_ROUNDS = 7           # alternating the two GEMMs, each one's best kept

Gemm = Callable[[torch.Tensor], torch.Tensor]


class NativePrefillGemm:
    def __init__(self, library: ctypes.CDLL) -> None:
        self._function = library.fairserve_prefill_gemm
        self._function.restype = ctypes.c_int
        self._function.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                                   ctypes.c_void_p, ctypes.c_int64]

    def runs(self) -> bool:
        """Whether this build of the kernel runs on this CPU (AVX2 and FMA)."""
        rows, weight, out = torch.zeros(1, 8), torch.zeros(PANEL * 8), torch.empty(1, PANEL)
        return self._function(rows.data_ptr(), 1, 8, weight.data_ptr(), PANEL, out.data_ptr(), 1) == 0

    def __call__(self, rows: torch.Tensor, panels: torch.Tensor, out_features: int) -> torch.Tensor:
        """rows [M, in] (float32, contiguous) times the weight whose panels ([out / 16][in][16],
        float32, at least out * in entries) `panels` holds -> [M, out]."""
        if rows.dtype != torch.float32 or not rows.is_contiguous() or rows.dim() != 2:
            raise ValueError("the prefill GEMM takes contiguous float32 rows [M, in]")
        in_features = rows.shape[1]
        if panels.numel() < out_features * in_features or panels.dtype != torch.float32:
            raise ValueError(f"panels of {panels.numel()} floats for a {out_features} x {in_features} weight")
        out = torch.empty(rows.shape[0], out_features)
        status = self._function(rows.data_ptr(), rows.shape[0], in_features, panels.data_ptr(), out_features,
                                out.data_ptr(), torch.get_num_threads())
        if status:
            raise ValueError(f"the prefill GEMM does not take {out_features} outputs (a multiple of {PANEL}) here")
        return out


def load_prefill_gemm(cache_dir: Path) -> NativePrefillGemm | None:
    gemm = load_binding(NativePrefillGemm, "prefill_gemm", cache_dir, "the library's GEMM serves prefill")
    return gemm if gemm is not None and gemm.runs() else None


@dataclass(frozen=True)
class Verdict:
    """What the start-up check found for one weight shape."""
    serves: bool
    same_bits: bool
    native_s: float = float("nan")     # best calibration call, seconds
    library_s: float = float("nan")

    def describe(self) -> str:
        timing = (f"; {self.native_s * 1e3:.2f} against {self.library_s * 1e3:.2f} ms at {CALIBRATION_ROWS} rows"
                  if not math.isnan(self.native_s) else "")
        bits = "the same bits as" if self.same_bits else "other bits than"
        return f"{'native' if self.serves else 'library'} ({bits} the library's GEMM{timing})"


def decide(mode: str, native: Gemm, library: Gemm, in_features: int, seed: int = 0) -> Verdict:
    """Whether `native` serves a shape whose wide steps `library` serves now, under `mode`."""
    if mode not in MODES:
        raise ValueError(f"CPU_PREFILL_GEMM must be one of {', '.join(MODES)}, not {mode!r}")
    if mode in ("library", "amx"):
        return Verdict(False, False)
    generator = torch.Generator().manual_seed(seed)
    probes = [torch.randn(rows, in_features, generator=generator) for rows in PROBE_ROWS]
    same = all(torch.equal(native(x), library(x)) for x in probes)
    if mode == "native" or not same:
        return Verdict(mode == "native", same)
    x = torch.randn(CALIBRATION_ROWS, in_features, generator=generator)
    best = {native: float("inf"), library: float("inf")}
    for _ in range(CALIBRATION_ROUNDS):        # alternating: the machine's drift hits both
        for gemm in best:
            started = time.perf_counter()
            gemm(x)
            best[gemm] = min(best[gemm], time.perf_counter() - started)
    return Verdict(best[native] < best[library], True, best[native], best[library])
