"""The LM head screen's int8 activations, for a head screened from its 8-bit codes
(`LMHeadScreen.from_codes`; the kernel is native/codes_screen_quads.c, AVX-512 with VNNI and
VBMI only).

The int16 codes kernel (codes_screen.c) multiplies two inputs an instruction (vpdpwssd); with
int8 activations vpdpbusd multiplies four, the codes being its unsigned bytes as they are.
Rounding a hidden state to int8 with one scale a row would be far too coarse for Gemma's,
where a few dimensions are 50x the rest, so each block of the codes' group (32 inputs on a
Q8_0 head) gets its own scale, max |x_b| / 127: only the blocks holding the large dimensions
take a coarse step. On Gemma 3 270M's hidden states that leaves a greedy row 2.5 candidates
for its exact logits on average (at most 12) where int16 leaves one, and the
bound stays the screen's usual one (lm_head_screen.py): the activation residual, computed
here, and the kernel's float32 rounding (codes_screen_bound.py, on the int8 grid).

`auto` (LM_HEAD_SCREEN_ACTIVATIONS) times both kernels on the head itself when the screen is
built and keeps the faster at a c32 step's rows: the int8 kernel's float work at every block
end is twice the int16 kernel's share, so it does not pay on every CPU or at every row count.
Where int8 is kept, an int16 screen may serve the narrow steps beside it (screen_rows.py).
"""

from __future__ import annotations

import time

import torch

from services.worker.engine.cpu.screen.int8_matmul import NativeInt8Matmul
from services.worker.engine.cpu.linear.weight_codes import CodedWeight

INT8_GRID = 127             # activation rows are integers in [-INT8_GRID, INT8_GRID]
ACTIVATIONS = ("auto", "int16", "int8")
PICK_ROWS = 32              # rows each kernel is timed on when `auto` picks (a c32 decode step)
PICK_ROUNDS = 3             # best of this many, alternating


def int8_available(native: NativeInt8Matmul, coded: CodedWeight) -> bool:
    """Whether the int8 kernel runs here and takes this head's codes."""
    return native.has_codes_quads and coded.bits == 8 and coded.group % 4 == 0 and coded.group <= 256


def quantize_blocks(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [rows, in] float32 -> (xq [rows, in] int8, scales [rows, in / group] float32, the
    residual x - q(x) [rows, in] float32), q(x) = xq * its block's scale, |xq| <= INT8_GRID."""
    rows, in_features = x.shape
    blocks = x.view(rows, -1, group)
    scales = (blocks.abs().amax(dim=2) / INT8_GRID).clamp_min(1e-30)
    rounded = (blocks / scales[..., None]).round_().clamp_(-INT8_GRID, INT8_GRID)
    residual = (blocks - rounded * scales[..., None]).view(rows, in_features)
    return rounded.view(rows, in_features).to(torch.int8), scales, residual


def approximate(native: NativeInt8Matmul, coded: CodedWeight, x: torch.Tensor,
                maxima: torch.Tensor | None, out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(approximate logits [rows, V] of x's int8 rounding, in `out` where given; the rounding's
    residual [rows, in])."""
    xq, scales, residual = quantize_blocks(x, coded.group)
    return native.codes_screen_quads(coded, xq, scales, maxima, out), residual


def check_rows(rows: int, in_features: int, group: int,
               generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Extreme and random int8 rows (full scale, alternating signs, random) and block scales
    for the kernel's check against float64."""
    x = torch.randint(-INT8_GRID, INT8_GRID + 1, (rows, in_features), generator=generator, dtype=torch.int8)
    x[0], x[1] = INT8_GRID, -INT8_GRID
    x[2, ::2], x[2, 1::2] = INT8_GRID, -INT8_GRID
    scales = torch.rand(rows, in_features // group, generator=generator) + 0.5
    return x, scales


def faster_activations(native: NativeInt8Matmul, coded: CodedWeight, rows: int = PICK_ROWS) -> str:
    """"int8" where its kernel ran this head faster than the int16 one at `rows` rows (best of
    PICK_ROUNDS each, alternating), else "int16"."""
    if not int8_available(native, coded):
        return "int16"
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, coded.in_features, generator=generator)
    x16 = torch.randint(-16383, 16384, (rows, coded.in_features), generator=generator, dtype=torch.int16)
    x_scale = torch.ones(rows)
    out = torch.empty(rows, coded.out_features)    # one output for both: a starting worker's peak
    kernels = {"int16": lambda: native.codes_screen(coded, x16, x_scale, None, None, out),
               "int8": lambda: approximate(native, coded, x, None, out)}
    best = dict.fromkeys(kernels, float("inf"))
    for _ in range(PICK_ROUNDS):
        for name, run in kernels.items():
            started = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - started)
    return "int8" if best["int8"] < best["int16"] else "int16"
