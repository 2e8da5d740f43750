"""The LM head screen's int8 copy of a float32 head (lm_head_screen.py, where the head is not
kept as 8-bit codes): each row rounded to int8 with a scale of its own, the norms the screen's
bound reads, and the C kernel's check on that copy against float64.
"""

from __future__ import annotations

import torch

from services.worker.engine.cpu.screen.int8_matmul import NATIVE_TILE, NativeInt8Matmul

QUANTIZE_CHUNK_ROWS = 16384
NORM_MARGIN = 1e-3          # the bound's norms widened by far more than their float32 rounding


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [V, H] float32 -> (int8 rows q [V, H], their float64 scales [V] (computed in
    float32, so exact in float32 too), |w - q * scale| and |q * scale| per row, float32 and
    widened by NORM_MARGIN so the bound never shrinks), a chunk of rows at a time."""
    vocab, hidden = weight.shape
    scales = torch.empty(vocab, dtype=torch.float64)
    error_norms = torch.empty(vocab, dtype=torch.float32)
    quant_norms = torch.empty(vocab, dtype=torch.float32)
    quantized = torch.empty(vocab, hidden, dtype=torch.int8)
    with torch.inference_mode():
        for start in range(0, vocab, QUANTIZE_CHUNK_ROWS):
            chunk = slice(start, start + QUANTIZE_CHUNK_ROWS)
            rows = weight[chunk]
            scale = (rows.abs().amax(dim=1) / 127).clamp_min(1e-30)
            q = (rows / scale[:, None]).round_().clamp_(-127, 127)
            dequantized = q * scale[:, None]
            scales[chunk] = scale
            quantized[chunk] = q
            error_norms[chunk] = (rows - dequantized).norm(dim=1) * (1 + NORM_MARGIN)
            quant_norms[chunk] = dequantized.norm(dim=1) * (1 + NORM_MARGIN)
    return quantized, scales, error_norms, quant_norms


def native_kernel_exact(native: NativeInt8Matmul, quantized: torch.Tensor, scales: torch.Tensor,
                        grid: int, generator: torch.Generator) -> bool:
    """The C kernel on rows of extreme and random int16 integers up to `grid` (more than one
    tile, some padding) equals the float64 product with the dequantized rows to within its
    float32 rounding."""
    weights = quantized.double() * scales[:, None]
    rows = torch.randint(-grid, grid + 1, (NATIVE_TILE + 3, weights.shape[1]), generator=generator)
    rows[0], rows[1] = grid, -grid
    x_scale = torch.rand(len(rows), generator=generator) + 0.5
    out = native(native.pack(quantized, scales.float()), rows.to(torch.int16), x_scale)
    reference = (rows.double() * x_scale[:len(rows), None].double()) @ weights.T
    magnitude = (rows.double().abs() * x_scale[:len(rows), None].double()) @ weights.abs().T
    return bool(((out.double() - reference).abs() <= 1e-6 * magnitude + 1e-6).all())
