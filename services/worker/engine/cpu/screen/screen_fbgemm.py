"""The LM head screen's fallback where the engine's C kernels do not build: approximate
logits from an int8 copy of the head through fbgemm's dynamic int8 linear (lm_head_screen.py
says how the screen bounds them).

fbgemm quantizes its input per tensor to 7 bits (`reduce_range`; AVX2's pairwise int16 sums
would saturate with 8), far too coarse for Gemma's hidden states, where a few dimensions are
50x the rest. So each row is scaled to [-63, 63] and split into two rows of integers, the
rounded row and its rounding residual x126, on a grid the op keeps exactly: one extra row
holds -64 and 63, so the op's scale is 1 and its zero point 64. The rounding left after the
second row is below 1/252 of a row's largest entry. `check` compares the op against a float64
reference before the screen is used.
"""

from __future__ import annotations

import warnings

import torch

GRID = 63                   # activation rows are integers in [-GRID, GRID]
FINE = 2 * GRID             # the residual row carries (residual * FINE)


def screening_available() -> bool:
    """Whether fbgemm's int8 op is here (the screen's fallback when the C kernel is not)."""
    return "fbgemm" in torch.backends.quantized.supported_engines and hasattr(torch.ops.quantized, "linear_dynamic")


class FbgemmHead:
    def __init__(self, quantized: torch.Tensor, scales: torch.Tensor) -> None:
        """`quantized` [V, H] int8 rows with float64 `scales` [V] (a scale per row)."""
        vocab, hidden = quantized.shape
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)   # quantized tensors' deprecation notice
            qweight = torch._make_per_channel_quantized_tensor(quantized, scales,
                                                               torch.zeros(vocab, dtype=torch.long), 0)
        self._packed = torch.ops.quantized.linear_prepack(qweight, None)
        self._ends = torch.zeros(1, hidden)
        self._ends[0, 0], self._ends[0, 1] = -GRID - 1, GRID

    def approximate(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(approximate logits [B, V], |x - q(x)| per row): one call over each row's coarse and
        residual grid rows."""
        rows = x.shape[0]
        scale = (x.abs().amax(dim=1, keepdim=True) / GRID).clamp_min(1e-30)
        scaled = x / scale
        coarse = scaled.round()
        fine = ((scaled - coarse) * FINE).round()
        residual = (scaled - coarse - fine / FINE) * scale
        grid = torch.cat([coarse, fine, self._ends])
        out = torch.ops.quantized.linear_dynamic(grid, self._packed, True)
        approx = torch.add(out[:rows], out[rows:2 * rows], alpha=1.0 / FINE).mul_(scale)
        # Computed in float32: a relative margin covers its rounding.
        return approx, residual.norm(dim=1) * (1 + 1e-4) + 1e-30

    def check(self, weights: torch.Tensor, generator: torch.Generator) -> bool:
        """The op on grid rows of extreme and random integers equals the float64 product of
        `weights` (the first rows' dequantized weights, float64) to within its float32 rounding."""
        rows = torch.randint(-GRID, GRID + 1, (3, weights.shape[1]), generator=generator).float()
        rows[0] = GRID
        rows[1] = -GRID
        grid = torch.cat([rows, self._ends])
        with torch.inference_mode():
            out = torch.ops.quantized.linear_dynamic(grid, self._packed, True)[:3, :len(weights)]
        reference = rows.double() @ weights.T
        magnitude = rows.double().abs() @ weights.abs().T
        return bool(((out.double() - reference).abs() <= 1e-6 * magnitude + 1e-6).all())
