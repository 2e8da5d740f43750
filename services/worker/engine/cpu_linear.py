"""Linear layers with pre-packed weights, for CPU decode batches.

float32 (MKL): sgemm repacks the weight matrix on every call. For the few-row
inputs of decode steps that packing costs more than the multiply itself; with
the weight packed once, 8 rows cost little more than one row. The packed layout
does not depend on the row count, so one pack serves every batch size. Where it
stops paying off depends on the shape (measured on the default model, 2
threads): the layers' 640x2048-sized weights run 1.1-3x faster packed up to 32
rows and break even near 64; the 262k x 640 LM head is 2.4x faster packed at 8
rows but slower from 16 rows on. So layers take the packed kernel up to 32
rows, the LM head up to 8, and larger inputs take the plain kernel.

bfloat16 (oneDNN, AMX or AVX512-BF16 where the CPU has them): a weight reordered
once into oneDNN's blocked layout skips the per-call reorder; 1-32 rows run
1.3-2.4x faster on the layers' shapes and the LM head at 32 rows 1.6x faster,
while 512-row prefill chunks are faster with the plain kernel. Both kinds keep
the original weight (shared, e.g. a tied embedding) beside the pack, which costs
one more copy of the weights in memory.
"""

from __future__ import annotations

import torch

PACK_ROWS_HINT = 8     # the pack's size and layout are the same for any row count
MAX_PACKED_ROWS = 32       # layer weights, either dtype
LM_HEAD_MAX_PACKED_ROWS = {torch.float32: 8, torch.bfloat16: 32}


def mkl_packing_available() -> bool:
    return hasattr(torch.ops, "mkl") and hasattr(torch.ops.mkl, "_mkl_linear") and torch.backends.mkl.is_available()


def onednn_bf16_packing_available() -> bool:
    mkldnn = getattr(torch.ops, "mkldnn", None)
    return (torch.backends.mkldnn.is_available() and mkldnn is not None
            and hasattr(mkldnn, "_linear_pointwise") and hasattr(mkldnn, "_reorder_linear_weight")
            and bool(mkldnn._is_mkldnn_bf16_supported()))


def packing_available(dtype: torch.dtype) -> bool:
    if dtype == torch.float32:
        return mkl_packing_available()
    if dtype == torch.bfloat16:
        return onednn_bf16_packing_available()
    return False


class PackedLinear(torch.nn.Module):
    def __init__(self, linear: torch.nn.Linear, max_packed_rows: int = MAX_PACKED_ROWS) -> None:
        super().__init__()
        self.max_packed_rows = max_packed_rows
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight          # kept (shared, e.g. a tied embedding); the pack is extra
        self.bias = linear.bias
        self._mkl = self.weight.dtype == torch.float32
        if not self._mkl and self.weight.dtype != torch.bfloat16:
            raise ValueError(f"no packed kernel for {self.weight.dtype}")
        with torch.no_grad():
            weight = self.weight.detach()
            packed = (torch.ops.mkl._mkl_reorder_linear_weight(weight, PACK_ROWS_HINT) if self._mkl
                      else torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS_HINT))
            self.register_buffer("packed", packed, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] > self.max_packed_rows:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        if self._mkl:
            out = torch.ops.mkl._mkl_linear(rows, self.packed, self.weight, self.bias, rows.shape[0])
        else:
            out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)


def pack_linears(module: torch.nn.Module, max_packed_rows: int = MAX_PACKED_ROWS) -> int:
    """Replaces every nn.Linear under `module` whose dtype has a packed kernel here
    by a PackedLinear; returns how many."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, torch.nn.Linear) and packing_available(child.weight.dtype):
            setattr(module, name, PackedLinear(child, max_packed_rows))
            count += 1
        else:
            count += pack_linears(child, max_packed_rows)
    return count
