"""ctypes binding of native/amx_coded_gemm.c, a float32 GEMM for wide steps on AMX, straight
from a linear's weight codes, and the start-up check of each weight shape that decides whether
it serves them (CPU_PREFILL_GEMM).

The kernel splits each float32 activation into three bfloat16 pieces that add up to it exactly
and multiplies them by the codes (small integers, exact in bfloat16) on AMX's bfloat16 tiles,
which add the exact products in float32; each block's sum then takes its scale and offset
in float32, as the codes define the weight. So it is a float32 GEMM: the same products,
float32 additions in another order than oneDNN's, not its bits. Its outputs are checked at
start against float64 on probes of several row counts, within a float32 GEMM's rounding
bound (`within_float32_bound`); `auto` takes it for all of a model's shapes or none: all
where every shape passed that check and a calibration at prefill's rows, summed over the
model's linears, runs it faster than the GEMMs it replaces (`settle`).
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from services.worker.engine.cpu.kernels.native_build import load_binding
from services.worker.engine.cpu.timing import best_alternating
from services.worker.engine.cpu.linear.weight_codes import PANEL, CodedWeight

UNIT_ROUNDOFF = 2.0 ** -24
PROBE_ROWS = (7, 40, 300)        # row counts checked against float64 (tiles, padding, chunks, threads)
CALIBRATION_ROWS = 1024
CALIBRATION_ROUNDS = 5           # alternating with the GEMM it would replace, each one's best kept (after a warm-up)
SPARE_ROUNDINGS = 8              # beyond the count derived in `float32_bound`: conversions, margin

Gemm = Callable[[torch.Tensor], torch.Tensor]
Shape = tuple[int, int]                  # (out_features, in_features)


class NativeAmxGemm:
    """The kernel. Its scratch (the split activations and the B tiles, ~25 MB for a 2,048-row
    step of the default model's widest input) is a step's buffer like the others: allocated per
    call from the heap glibc keeps, and handed back with them after a burst of wide steps
    (`HOST_MEMORY_RELEASE_ROWS`)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self._available = library.fairserve_amx_available
        self._available.restype = ctypes.c_int
        self._available.argtypes = []
        self._scratch_bytes = library.fairserve_amx_scratch_bytes
        self._scratch_bytes.restype = ctypes.c_int64
        self._scratch_bytes.argtypes = [ctypes.c_int64] * 4
        self._function = library.fairserve_amx_coded_gemm
        self._function.restype = ctypes.c_int
        self._function.argtypes = ([ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64] + [ctypes.c_void_p] * 3
                                   + [ctypes.c_int64] * 2 + [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                                             ctypes.c_int64])

    def runs(self) -> bool:
        """Whether this build runs here: AMX-BF16 in the build and the tiles granted."""
        return bool(self._available())

    def takes(self, coded: CodedWeight) -> bool:
        """Whether the kernel takes `coded`: blocks of 16 or 32, float scales and offsets."""
        return coded.group in (16, 32) and coded.in_features % coded.group == 0 and coded.zeros is None

    def __call__(self, rows: torch.Tensor, coded: CodedWeight) -> torch.Tensor:
        """rows [M, in] (float32, contiguous) times `coded`'s float32 weight -> [M, out]."""
        if rows.dtype != torch.float32 or not rows.is_contiguous() or rows.dim() != 2:
            raise ValueError("the AMX GEMM takes contiguous float32 rows [M, in]")
        threads = torch.get_num_threads()
        scratch = torch.empty(self._scratch_bytes(rows.shape[0], coded.in_features, coded.group, coded.out_features),
                              dtype=torch.uint8)
        scales, offsets = coded.float_scales()
        out = torch.empty(rows.shape[0], coded.out_features)
        status = self._function(rows.data_ptr(), rows.shape[0], coded.in_features, coded.codes.data_ptr(),
                                scales.data_ptr(), offsets.data_ptr(), coded.group, coded.bits, out.data_ptr(),
                                coded.out_features, scratch.data_ptr(), threads)
        if status:
            raise ValueError(f"the AMX GEMM does not take this weight here (status {status})")
        return out


def load_amx_gemm(cache_dir: Path) -> NativeAmxGemm | None:
    gemm = load_binding(NativeAmxGemm, "amx_coded_gemm", cache_dir, "no AMX GEMM serves prefill")
    return gemm if gemm is not None and gemm.runs() else None


def float32_bound(x: torch.Tensor, coded: CodedWeight, alpha: torch.Tensor | None = None) -> torch.Tensor:
    """[M, out] float64: how far a float32 GEMM of `coded` may land from the exact product.
    Each block's sum adds 3 G exact products (gamma_3G), takes its scale and its offset's
    term by two roundings, and the blocks add up in 2 B more; the float32 weight itself is
    scale * code + offset rounded twice. All of it within (3 G + 2 B + 4) u of
    sum_k |x_k| alpha_k, alpha_k = code_k |scale| + |offset| (codes_screen_bound.py's alpha,
    `alpha_rows`, computed here unless given), with SPARE_ROUNDINGS more for the block sums
    X_b and slack."""
    alpha = alpha_rows(coded) if alpha is None else alpha
    roundings = 3 * coded.group + 2 * (coded.in_features // coded.group) + 4 + SPARE_ROUNDINGS
    return (x.double().abs() @ alpha.T) * (roundings * UNIT_ROUNDOFF)


def alpha_rows(coded: CodedWeight) -> torch.Tensor:
    """[out, in] float64: code_k |scale| + |offset| of every weight entry."""
    ids = torch.arange(coded.out_features)
    scales, offsets = coded.float_scales()
    panel, lane = ids // PANEL, ids % PANEL
    s = scales[panel, :, lane].double().repeat_interleave(coded.group, dim=1)
    o = offsets[panel, :, lane].double().repeat_interleave(coded.group, dim=1)
    return coded.code_rows(ids).double() * s.abs() + o.abs()


def within_float32_bound(amx: NativeAmxGemm, coded: CodedWeight, seed: int = 0) -> bool:
    """The kernel's outputs on probes of PROBE_ROWS rows (random, with a few columns 50x the
    rest, as Gemma's hidden states have) within `float32_bound` of the float64 product."""
    generator = torch.Generator().manual_seed(seed)
    weight = coded.rows(torch.arange(coded.out_features)).double()
    alpha = alpha_rows(coded)                        # once a shape, for every probe
    for rows in PROBE_ROWS:
        x = torch.randn(rows, coded.in_features, generator=generator)
        x[:, :: max(1, coded.in_features // 3)] *= 50
        exact = x.double() @ weight.T
        if not bool(((amx(x, coded).double() - exact).abs() <= float32_bound(x, coded, alpha)).all()):
            return False
    return True


@dataclass(frozen=True)
class AmxVerdict:
    """What the start-up check found for one weight shape."""
    serves: bool
    within_bound: bool
    amx_s: float = float("nan")       # best calibration call, seconds
    library_s: float = float("nan")

    def describe(self) -> str:
        timing = (f"; {self.amx_s * 1e3:.2f} against {self.library_s * 1e3:.2f} ms at {CALIBRATION_ROWS} rows"
                  if not math.isnan(self.amx_s) else "")
        bound = "within" if self.within_bound else "outside"
        return f"{'AMX' if self.serves else 'not AMX'} ({bound} a float32 GEMM's rounding bound{timing})"


def decide_amx(mode: str, amx: NativeAmxGemm, coded: CodedWeight, library: Gemm, seed: int = 0) -> AmxVerdict:
    """Whether the AMX GEMM serves `coded`'s shape, under CPU_PREFILL_GEMM `mode`: `amx`
    wherever it takes the weight and stays within the bound, `auto` where it also ran faster
    than `library` (what serves the shape otherwise; `settle` then gives one answer for all
    shapes), `native` and `library` never."""
    if mode not in ("auto", "amx") or not amx.takes(coded):
        return AmxVerdict(False, False)
    if not within_float32_bound(amx, coded, seed):
        return AmxVerdict(False, False)
    if mode == "amx":
        return AmxVerdict(True, True)
    x = torch.randn(CALIBRATION_ROWS, coded.in_features, generator=torch.Generator().manual_seed(seed + 1))
    amx_s, library_s = best_alternating([lambda: amx(x, coded), lambda: library(x)], CALIBRATION_ROUNDS)
    return AmxVerdict(amx_s < library_s, True, amx_s, library_s)


def settle(mode: str, verdicts: dict[Shape, AmxVerdict], linears: Counter[Shape]) -> dict[Shape, AmxVerdict]:
    """Under `auto`, one answer for all of a model's shapes, so that its outputs do not hang on
    one shape's timing noise from one start to the next (the AMX GEMM's bits are not the
    library's): it serves them all where every shape is within the bound and the calibration
    times, each shape's counted once a linear of it (`linears`), add up to less than what serves
    them otherwise; none of them else. Under another mode, the verdicts as they are."""
    if mode != "auto" or not verdicts:
        return verdicts
    bounded = all(verdict.within_bound for verdict in verdicts.values())
    amx_s = sum(verdict.amx_s * linears[shape] for shape, verdict in verdicts.items())
    library_s = sum(verdict.library_s * linears[shape] for shape, verdict in verdicts.items())
    serves = bounded and amx_s < library_s
    return {shape: dataclasses.replace(verdict, serves=serves) for shape, verdict in verdicts.items()}
