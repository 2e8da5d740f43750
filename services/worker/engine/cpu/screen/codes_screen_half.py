"""Half-float scales for the LM head screen's codes kernel (native/codes_screen.c,
`fairserve_codes_screen_half`).

A screen from one activation row streams the whole head, so its time is the head's bytes: the
8-bit codes and, per block of 32 inputs, a float32 scale and a float32 offset, 1.25 bytes a
weight. A Q8_0 head's blocks are scale * q with a half-float scale and q in [-127, 127]; its
codes (weight_codes.py: code = q - min q of the block) have offsets of -zero * scale, zero a
byte (-min q). The kernel can then read each block's scale as a half float and its zero as a
byte, and compute the offset (one exact product), 1 + 3/32 bytes a weight, for the same
outputs bit for bit. Heads whose codes are not like that keep the float scales and offsets.

The conversions cost more than the bytes save wherever the pass is not bound by memory: on
the 2-core AMD EPYC Zen 3, a one-row pass over Gemma 3's head is 1.08-1.13x faster from half
scales, an 8-row one 0.97x. So when the screen is built the two are timed at 1, 2, 4 and 8
rows, and the half scales serve up to the most rows at which they were faster at every
count timed below it (`half_rows_limit`); on a CPU where they never are, they are let go."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from services.worker.engine.cpu.screen.int8_matmul import PANEL, NativeInt8Matmul
from services.worker.engine.cpu.timing import best_alternating
from services.worker.engine.cpu.linear.weight_codes import CodedWeight

CHECK_ROWS = 11             # activation rows of the check: every tile width and a remainder
CHECK_VOCAB = 4093          # tokens of the check: many panels, the last one partial
PICK_ROUNDS = 3             # best of this many passes over the head each, alternating
PICK_ROWS = (1, 2, 4, 8)    # the row counts timed
EVERY_ROW = 1 << 30         # max_rows of the half scales of a weight in the half form (it has no float ones)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HalfScales:
    """A coded weight's scales as half floats and its offsets as -zero * scale, both
    [panels, blocks, PANEL] like the scales they stand for (float16 and uint8, contiguous);
    `max_rows`: the most activation rows a pass reads them for (more read the float ones)."""
    scales: torch.Tensor
    zeros: torch.Tensor
    max_rows: int = PICK_ROWS[-1]

    def panels(self, count: int) -> "HalfScales":
        """Those of the first `count` panels (views)."""
        return HalfScales(self.scales[:count], self.zeros[:count], self.max_rows)

    def serves(self, rows: int) -> bool:
        return rows <= self.max_rows


def half_scales(coded: CodedWeight) -> HalfScales | None:
    """`coded`'s scales and offsets as HalfScales where every scale is a finite half float
    exactly and every offset is exactly -zero * scale with zero an integer in [0, 255] (a zero
    scale takes zero 0 and needs a zero offset); else None. A weight in the half form gives its
    own (weight_codes.py)."""
    half = coded.half_form()
    if half is None:
        return None
    assert half.zeros is not None
    return HalfScales(half.scales, half.zeros)


def checked_half_scales(native: NativeInt8Matmul, coded: CodedWeight, grid: int) -> HalfScales | None:
    """The half scales the screen's int16 kernel reads for `coded` (up to their `max_rows`),
    where `half_scales` has them, the half-scale kernel gives the float one's outputs here
    (`half_kernel_agrees`) and is faster at one row at least (`half_rows_limit`); else None,
    and the kernel reads the float scales and offsets. A weight in the half form (the LM head
    kept so, coded_head.py) reads its half scales at every row count once the kernel agrees;
    None when it does not."""
    half = half_scales(coded)
    if half is None:
        return None
    if not half_kernel_agrees(native, coded, half, grid):
        log.warning("LM head screen: the half-scale kernel differs from the float one here; float scales")
        return None
    if coded.half:
        return HalfScales(half.scales, half.zeros, EVERY_ROW)     # no float scales kept to read instead
    limit = half_rows_limit(native, coded, half, grid)
    return HalfScales(half.scales, half.zeros, limit) if limit else None


def half_rows_limit(native: NativeInt8Matmul, coded: CodedWeight, half: HalfScales, grid: int,
                    rounds: int = PICK_ROUNDS) -> int:
    """The most rows of PICK_ROWS up to which the half-scale kernel's best pass over the head
    beat the float one's at every count timed; 0 where it did not at one row."""
    generator = torch.Generator().manual_seed(1)
    limit = 0
    for rows in PICK_ROWS:
        x = torch.randint(-grid, grid + 1, (rows, coded.in_features), generator=generator).to(torch.int16)
        x_scale = torch.ones(rows)
        floats, halves = best_alternating((lambda: native.codes_screen(coded, x, x_scale),
                                           lambda: native.codes_screen(coded, x, x_scale, None, half)), rounds)
        log.info("LM head screen: %d-row pass %.2f ms from half scales, %.2f ms from float ones",
                 rows, halves * 1e3, floats * 1e3)
        if halves >= floats:
            break
        limit = rows
    return limit


def half_kernel_agrees(native: NativeInt8Matmul, coded: CodedWeight, half: HalfScales, grid: int,
                       rows: int = CHECK_ROWS, vocab: int = CHECK_VOCAB) -> bool:
    """The half-scale kernel's outputs and panel maxima equal the float kernel's, bit for bit,
    on `rows` rows of extreme and random int16 integers in [-grid, grid] over the head's first
    `vocab` tokens."""
    vocab = min(vocab, coded.out_features)
    part = coded.panel_rows(0, vocab).float_form()
    generator = torch.Generator().manual_seed(0)
    x = torch.randint(-grid, grid + 1, (rows, coded.in_features), generator=generator)
    x[0], x[1] = grid, -grid
    x = x.to(torch.int16)
    x_scale = torch.rand(rows, generator=generator) + 0.5
    panels = -(-vocab // PANEL)
    maxima = torch.empty(rows, panels), torch.empty(rows, panels)
    floats = native.codes_screen(part, x, x_scale, maxima[0])
    halves = native.codes_screen(part, x, x_scale, maxima[1], half.panels(part.scales.shape[0]))
    return torch.equal(floats, halves) and torch.equal(*maxima)
