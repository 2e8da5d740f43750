"""The float32 GEMM rate this CPU reaches on one decoder layer's linear shapes, alone:
each weight packed once for the kernel (oneDNN's blocked layout, or MKL's pack), then
the layer's seven GEMMs back to back on `rows` input rows, best of `repeats` rounds.
That is the kernel's peak for the shapes the steps run, measured in the same process
as the profile (and so under the same load), against which the steps' achieved rate
is read."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from services.worker.engine.cpu.cpu_linear import kernel_available


def _packed_call(kernel: str, weight: torch.Tensor, rows: int):
    if kernel == "onednn":
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
        return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    if kernel == "mkl":
        packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)
        return lambda x: torch.ops.mkl._mkl_linear(x, packed, weight, None, x.shape[0])
    return lambda x: torch.nn.functional.linear(x, weight)


def gemm_gflops(shapes: list[tuple[int, int]], rows: int, kernel: str = "onednn", repeats: int = 7,
                now: Callable[[], float] = time.perf_counter) -> float | None:
    """GFLOP/s of `kernel` ("onednn", "mkl" or "plain" torch.mm) over the (in, out) `shapes`
    at `rows` rows, per second of `now` (the profile's clock); None when the kernel is not
    available here."""
    if kernel != "plain" and not kernel_available(kernel, torch.float32):
        return None
    generator = torch.Generator().manual_seed(0)
    calls, inputs = [], []
    with torch.inference_mode():
        for in_features, out_features in shapes:
            weight = torch.randn(out_features, in_features, generator=generator) * 0.02
            calls.append(_packed_call(kernel, weight, rows))
            inputs.append(torch.randn(rows, in_features, generator=generator))
        flops = sum(2.0 * rows * i * o for i, o in shapes)
        best = float("inf")
        for _ in range(repeats + 1):          # the first round (warming up) is never the best
            started = now()
            for call, x in zip(calls, inputs):
                call(x)
            best = min(best, now() - started)
    return flops / best / 1e9
