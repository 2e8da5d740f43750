"""The LM head screen's error bound when it multiplies the head's 8-bit weight codes
(lm_head_screen.py, `LMHeadScreen.from_codes`; the kernel is native/codes_screen.c): the
row norms it needs, computed once from the codes, and the kernel's float32 rounding as a
multiple of each row's norm."""

from __future__ import annotations

import torch

from services.worker.engine.cpu.screen.codes_screen_int8 import check_rows as int8_check_rows
from services.worker.engine.cpu.screen.int8_matmul import PANEL, NativeInt8Matmul
from services.worker.engine.cpu.linear.weight_codes import CodedWeight

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
        scales, offsets = coded.panel_rows(first * panel, min((first + CODES_CHUNK_PANELS) * panel,
                                                               coded.out_features)).float_scales()
        scales, offsets = scales[:, :, None, :], offsets[:, :, None, :]
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
    ||alpha_v|| widened by norm_margin for its float32 rounding (and x's norm's).

    The int8 kernel (native/codes_screen_quads.c, codes_screen_int8.py) fits the same bound
    with grid 127: q(x) = xs_b * xq has a scale per block, xs_b <= (1 + u) max|x| / grid, so
    delta holds; its terms are fl(U_b xs_b) scale_b and offset_b fl(xs_b X_b), each within u
    of exact (U_b, X_b exact integers), summed in float32 by 2B fused multiply-adds with no
    last product, within (gamma_2B (1 + u)) S, S = sum_i alpha_i |q(x)_i|."""
    blocks = coded.in_features // coded.group
    if (2 * blocks + 4) * UNIT_ROUNDOFF >= 1e-4:
        raise ValueError(f"codes screen: {blocks} blocks a row, too many for its rounding bound")
    delta = 0.51 * coded.in_features ** 0.5 / grid
    roundings = (2 * blocks + 4) * (1 + delta) * (1 + 1e-3) + CODES_SPARE_ROUNDINGS
    return alpha_norms * (roundings * UNIT_ROUNDOFF * (1 + norm_margin))


def codes_kernel_within_bound(native: NativeInt8Matmul, coded: CodedWeight, error_norms: torch.Tensor,
                              activations: str, int16_grid: int, rows: int) -> bool:
    """The codes kernel for `activations` (int16 or int8) on `rows` rows of extreme and random
    integers against the float64 product of the float32 weights `coded` stands for: every
    output within the float rounding part of the bound (`error_norms` times the norm of the
    row the kernel multiplied), and the panel maxima those of the outputs. `coded`: a few
    thousand vocabulary rows, the last panel padded."""
    vocab = coded.out_features
    weights = coded.rows(torch.arange(vocab)).double()
    generator = torch.Generator().manual_seed(0)
    maxima = torch.empty(rows, -(-vocab // PANEL))
    if activations == "int8":
        x, scales = int8_check_rows(rows, coded.in_features, coded.group, generator)
        out = native.codes_screen_quads(coded, x, scales, maxima)
        scaled = (x.double().view(rows, -1, coded.group) * scales.double()[..., None]).view(rows, -1)
    else:
        x = torch.randint(-int16_grid, int16_grid + 1, (rows, coded.in_features), generator=generator)
        x[0], x[1] = int16_grid, -int16_grid
        x[2, ::2], x[2, 1::2] = int16_grid, -int16_grid
        x_scale = torch.rand(rows, generator=generator) + 0.5
        out = native.codes_screen(coded, x.to(torch.int16), x_scale, maxima)
        scaled = x.double() * x_scale.double()[:, None]
    allowed = scaled.norm(dim=1)[:, None] * error_norms.double()
    padded = torch.nn.functional.pad(out, (0, maxima.shape[1] * PANEL - vocab), value=float("-inf"))
    return bool(((out.double() - scaled @ weights.T).abs() <= allowed).all()
                and torch.equal(maxima, padded.view(rows, -1, PANEL).amax(dim=-1)))
