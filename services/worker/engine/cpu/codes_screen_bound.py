"""The LM head screen's error bound when it multiplies the head's 8-bit weight codes
(lm_head_screen.py, `LMHeadScreen.from_codes`; the kernel is native/codes_screen.c): the
row norms it needs, computed once from the codes, and the kernel's float32 rounding as a
multiple of each row's norm."""

from __future__ import annotations

import torch

from services.worker.engine.cpu.weight_codes import CodedWeight

UNIT_ROUNDOFF = 2.0 ** -24  # float32's relative rounding error at most
# The codes kernel's rounding bound, in units of UNIT_ROUNDOFF * ||alpha_v|| * ||x||, beyond
# what `codes_error_norms` derives: the float32 norms' own rounding and a margin.
CODES_SPARE_ROUNDINGS = 12
CODES_CHUNK_PANELS = 256    # panels of codes expanded at a time for the row norms (8192 rows)


def coded_row_norms(coded: CodedWeight, panel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per vocabulary row v, both [V] float32 from the 8-bit codes, a chunk of panels at a time:
    ||w_v||, the norm of the float32 row the codes stand for (expanded as CodedWeight.rows
    does: scale * code, rounded, plus offset, rounded), and ||alpha_v||, the norm of
    alpha_i = code_i * |scale_b| + |offset_b| (entry i of block b), which bounds every term
    of the codes kernel (`codes_error_norms`). Float32 sums of `hidden` squares: norm_margin
    covers their rounding."""
    panels, in_features, _ = coded.codes.shape
    blocks, group = in_features // coded.group, coded.group
    row_norms, alpha_norms = torch.empty(panels, panel), torch.empty(panels, panel)
    for first in range(0, panels, CODES_CHUNK_PANELS):
        chunk = slice(first, first + CODES_CHUNK_PANELS)
        codes = coded.codes[chunk].view(-1, blocks, group, panel).float()
        scales, offsets = coded.scales[chunk, :, None, :], coded.offsets[chunk, :, None, :]
        row_norms[chunk] = torch.mul(codes, scales).add_(offsets).square_().sum(dim=(1, 2)).sqrt_()
        alpha_norms[chunk] = codes.mul_(scales.abs()).add_(offsets.abs()).square_().sum(dim=(1, 2)).sqrt_()
    return row_norms.view(-1)[:coded.out_features], alpha_norms.view(-1)[:coded.out_features]


def codes_error_norms(alpha_norms: torch.Tensor, coded: CodedWeight, grid: int, norm_margin: float) -> torch.Tensor:
    """error_norms[v] such that |x.w_v - out[v]| <= error_norms[v] * ||x|| + (x - q(x)).w_v for
    the codes kernel's out (native/codes_screen.c) on q(x) = x_scale * xq, xq the int16 row
    (|xq| <= grid, x_scale = max|x| / grid). With u = 2^-24, B = in / group blocks,
    alpha_i = code_i |scale_b| + |offset_b| and S = sum_i alpha_i |xq_i| <= ||alpha|| ||xq||
    (Cauchy-Schwarz):

    - the float32 weight is w_i = fl(fl(scale_b code_i) + offset_b) (weight_codes.py's `find`
      checks it bit for bit), so |w_i - (scale_b code_i + offset_b)| <= 2u(1 + u) alpha_i, and
      x_scale |xq . (w - (scale code + offset))| <= 2u(1 + u) x_scale S;
    - the kernel's sum over blocks of scale_b fl(U_b) + offset_b X_b is a recursive float32
      sum of 2B terms, one rounding each (fused multiply-adds), of absolute sum at most
      (1 + u) S (U_b and X_b exact integers, fl(U_b) within u |U_b|): its error is at most
      (gamma_2B (1 + u) + u) S, gamma_n = n u / (1 - n u); the last product by x_scale adds
      u x_scale |sum|;
    - all told at most (2B + 4) u (1 + 1e-3) x_scale S for (2B + 4) u < 1e-4, and
      x_scale ||xq|| <= ||x|| + ||x - q(x)|| <= ||x|| (1 + delta), delta = 0.51 sqrt(in) / grid
      (each entry rounds by at most half a step, x_scale, plus float32 slop, and
      x_scale <= (1 + u) max|x| / grid <= (1 + u) ||x|| / grid).

    So error_norms[v] = ((2B + 4)(1 + delta)(1 + 1e-3) + CODES_SPARE_ROUNDINGS) u ||alpha_v||,
    ||alpha_v|| widened by norm_margin for its float32 rounding (and x's norm's)."""
    blocks = coded.in_features // coded.group
    if (2 * blocks + 4) * UNIT_ROUNDOFF >= 1e-4:
        raise ValueError(f"codes screen: {blocks} blocks a row, too many for its rounding bound")
    delta = 0.51 * coded.in_features ** 0.5 / grid
    roundings = (2 * blocks + 4) * (1 + delta) * (1 + 1e-3) + CODES_SPARE_ROUNDINGS
    return alpha_norms * (roundings * UNIT_ROUNDOFF * (1 + norm_margin))
