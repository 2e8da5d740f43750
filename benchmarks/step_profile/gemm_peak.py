"""The float32 GEMM rate this CPU reaches on one decoder layer's linear shapes, alone:
each weight packed once for the kernel (oneDNN's blocked layout, or MKL's pack), then
the layer's seven GEMMs back to back on the step's own number of rows.

`ReferenceGemms.sample` runs them once right after each profiled step (outside its
timers), so the reference is measured at the same moments as the steps' GEMMs and
under the same load from other processes: on a shared machine a peak measured once,
before or after, can sit on either side of what the steps saw. `rate(kind)` is the
flops of all its samples over their time."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable

import torch

from services.worker.engine.cpu.linear.cpu_linear import kernel_available

PACK_ROWS_HINT = {"prefill": 2048, "decode": 32}


def packed_call(kernel: str, weight: torch.Tensor, rows: int) -> Callable[[torch.Tensor], torch.Tensor]:
    if kernel == "onednn":
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
        return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    if kernel == "mkl":
        packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)
        return lambda x: torch.ops.mkl._mkl_linear(x, packed, weight, None, x.shape[0])
    return lambda x: torch.nn.functional.linear(x, weight)


class ReferenceGemms:
    def __init__(self, shapes: list[tuple[int, int]], kernel: str = "onednn",
                 now: Callable[[], float] = time.perf_counter) -> None:
        if kernel != "plain" and not kernel_available(kernel, torch.float32):
            raise ValueError(f"no {kernel} float32 kernel on this CPU")
        self.shapes, self.kernel, self._now = shapes, kernel, now
        self._calls: dict[str, list] = {}
        self._inputs: dict[str, list[torch.Tensor]] = {}
        self.flops: dict[str, float] = defaultdict(float)
        self.seconds: dict[str, float] = defaultdict(float)
        self.rows: dict[str, int] = defaultdict(int)
        self.samples: dict[str, int] = defaultdict(int)
        self.spent_s = 0.0           # everything `sample` took, packing included

    def _prepare(self, kind: str, rows: int) -> None:
        generator = torch.Generator().manual_seed(0)
        hint = PACK_ROWS_HINT.get(kind, rows)
        weights = [torch.randn(o, i, generator=generator) * 0.02 for i, o in self.shapes]
        self._calls[kind] = [packed_call(self.kernel, w, hint) for w in weights]
        width = max(i for i, _ in self.shapes)
        self._inputs[kind] = [torch.randn(max(rows, hint), width, generator=generator)]
        for call, (i, _) in zip(self._calls[kind], self.shapes):   # warm the kernel up
            call(self._inputs[kind][0][:rows, :i].contiguous())

    def sample(self, kind: str, rows: int) -> None:
        """The layer's GEMMs once at `rows` rows, timed, added to `kind`'s totals."""
        began = self._now()
        with torch.inference_mode():
            if kind not in self._calls or self._inputs[kind][0].shape[0] < rows:
                self._prepare(kind, rows)
            inputs = [self._inputs[kind][0][:rows, :i].contiguous() for i, _ in self.shapes]
            started = self._now()
            for call, x in zip(self._calls[kind], inputs):
                call(x)
            self.seconds[kind] += self._now() - started
        self.flops[kind] += sum(2.0 * rows * i * o for i, o in self.shapes)
        self.rows[kind] += rows
        self.samples[kind] += 1
        self.spent_s += self._now() - began

    def reset(self) -> None:
        """Forgets the samples (between passes); the packed weights stay."""
        for table in (self.flops, self.seconds, self.rows, self.samples):
            table.clear()
        self.spent_s = 0.0

    def rate(self, kind: str) -> float | None:
        """GFLOP/s over every sample of `kind`; None before any."""
        return self.flops[kind] / self.seconds[kind] / 1e9 if self.seconds.get(kind) else None
