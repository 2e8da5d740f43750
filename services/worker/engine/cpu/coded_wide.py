"""Wide steps of coded linears without a float32 copy of their weights (CPU_PREFILL_WEIGHTS=codes).

A coded linear's few-row steps run from its codes (weight_codes.py); its wide steps (prefill
chunks of more than weight_codes.MAX_ROWS rows) otherwise multiply a float32 pack of the
weight, kept resident beside the codes (~380 MB on the default model). Here each wide step
expands the linear's weight from its codes instead ([out, in], row-major) into one scratch
that all the model's linears share (the largest weight's size, a few MB, so it stays in
cache), and multiplies it as a plain float32 GEMM. The weights are the float32 ones bit for
bit; the cost is one expansion per linear per wide step (~0.14 ms for 2048 x 640), and a
GEMM that lays the weight out for itself on each call.
"""

from __future__ import annotations

import torch

from services.worker.engine.cpu.weight_codes import CodedWeight, NativeCodedLinear

PREFILL_WEIGHTS_MODES = ("packs", "codes")


class WideFromCodes:
    """rows [M, in] @ weight.T (+ bias) for a coded weight, expanded into a shared scratch.
    Steps run one at a time (the engine's thread), so one scratch serves every linear.

    With `onednn` the product is oneDNN's linear on the plain (unpacked) weight: the same
    float32 outputs bit for bit as oneDNN's pack of it (which it reorders to on each call),
    at 92-95 % of the pack's speed on 512 rows, expansion included (AMD EPYC Zen 5); else
    torch's linear."""

    def __init__(self, kernel: NativeCodedLinear, onednn: bool) -> None:
        self.kernel = kernel
        self.onednn = onednn
        self._scratch = torch.empty(0)

    def __call__(self, rows: torch.Tensor, coded: CodedWeight, bias: torch.Tensor | None) -> torch.Tensor:
        entries = coded.in_features * coded.out_features
        if self._scratch.numel() < entries:
            self._scratch = torch.empty(entries)
        weight = self.kernel.expand_into(coded, self._scratch)
        if self.onednn:
            return torch.ops.mkldnn._linear_pointwise(rows, weight, bias, "none", [], "")
        return torch.nn.functional.linear(rows, weight, bias)
