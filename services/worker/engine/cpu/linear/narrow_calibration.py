"""Whether narrow weight codes serve this CPU better than a byte a code (CPU_WEIGHT_CODES=auto).

Narrow codes (weight_codes.py `narrow`) read 0.5-0.75 bytes a weight instead of 1 and cost a
few more instructions to unpack; which of the two wins depends on the CPU and on how many rows
share each unpacked weight. So `auto` times the model's own coded linears, both widths taking
turns (best of `repeats`), at the two ends of the rows the coded kernel serves:

  - one row (batch-1 decode), where the weights stream from memory and fewer bytes pay;
  - MAX_ROWS rows (a full decode batch), where each unpacked weight serves many rows and the
    unpacking's instructions weigh most.

Narrow codes are kept when they are faster at one row and at most NARROW_TOLERANCE slower at
MAX_ROWS rows (the timings' own noise). Timing the model's own matrices, as the steps read them
(~60-100 MB, past every cache), is the point: small matrices that stay in cache time the
instructions alone and, on the 2-core AMD EPYC Zen 5, said narrow codes were ~20 % slower at one
row where the model's own linears run 1.2x faster from them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.worker.engine.cpu.linear.weight_codes import MAX_ROWS, CodedWeight, NativeCodedLinear
from services.worker.engine.cpu.timing import best_alternating

CALIBRATION_ROWS = (1, MAX_ROWS)
NARROW_TOLERANCE = 0.02     # how much slower narrow codes may be at MAX_ROWS rows and still be kept
REPEATS = 7                 # passes of each width at each row count, taking turns


@dataclass(frozen=True)
class WidthTimings:
    """Seconds of one pass over the calibrated linears, per CALIBRATION_ROWS entry, from 8-bit
    (`wide`) and from narrow codes."""
    rows: tuple[int, ...]
    wide: tuple[float, ...]
    narrow: tuple[float, ...]

    @property
    def speedups(self) -> tuple[float, ...]:
        """wide / narrow per row count: above 1, narrow codes are faster."""
        return tuple(w / n for w, n in zip(self.wide, self.narrow))

    @property
    def keeps_narrow(self) -> bool:
        """Faster at the first row count (one row), at most NARROW_TOLERANCE slower at the others."""
        return (self.narrow[0] < self.wide[0]
                and all(n <= w * (1 + NARROW_TOLERANCE) for w, n in zip(self.wide[1:], self.narrow[1:])))

    def describe(self) -> str:
        return ", ".join(f"{rows} row{'s' if rows > 1 else ''} {speedup:.2f}x"
                         for rows, speedup in zip(self.rows, self.speedups))


def time_widths(kernel: NativeCodedLinear, wide: Sequence[CodedWeight], narrow: Sequence[CodedWeight],
                repeats: int = REPEATS, rows: Sequence[int] = CALIBRATION_ROWS) -> WidthTimings:
    """Times `kernel` over the pairs of `wide` (8-bit) and `narrow` codes of the same matrices,
    at each of `rows`, the widths taking turns; a pair whose narrow codes are no narrower (no
    narrower width holds them) is left out. Raises ValueError when no pair is left."""
    pairs = [(w, n) for w, n in zip(wide, narrow, strict=True) if n.bits < w.bits]
    if not pairs:
        raise ValueError("no matrix has codes narrower than a byte to time")
    generator = torch.Generator().manual_seed(0)
    wide_seconds, narrow_seconds = [], []
    for count in rows:
        inputs = {w.in_features: torch.randn(count, w.in_features, generator=generator) for w, _ in pairs}
        best = best_alternating((lambda: [kernel(inputs[w.in_features], w, None) for w, _ in pairs],
                                 lambda: [kernel(inputs[n.in_features], n, None) for _, n in pairs]), repeats)
        wide_seconds.append(best[0])
        narrow_seconds.append(best[1])
    return WidthTimings(tuple(rows), tuple(wide_seconds), tuple(narrow_seconds))
