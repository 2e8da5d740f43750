"""Linear layers with MKL-packed weights, for CPU float32 decode batches.

MKL's sgemm repacks the weight matrix on every call. For the few-row inputs of
decode steps that packing costs more than the multiply itself; with the weight
packed once, 8 rows cost little more than one row. The packed layout does not
depend on the row count, so one pack serves every batch size. Where it stops
paying off depends on the shape (measured on the default model, 2 threads):
the layers' 640x2048-sized weights run 1.1-3x faster packed up to 32 rows and
break even near 64; the 262k x 640 LM head is 2.4x faster packed at 8 rows but
slower from 16 rows on. So layers take the packed kernel up to 32 rows, the LM
head up to 8, and larger inputs take the plain kernel. Costs about 0.8 GB more resident memory
on the default model.
"""

from __future__ import annotations

import torch

PACK_ROWS_HINT = 8     # the pack's size and layout are the same for any row count
MAX_PACKED_ROWS = 32       # layer weights
LM_HEAD_MAX_PACKED_ROWS = 8


def mkl_packing_available() -> bool:
    return hasattr(torch.ops, "mkl") and hasattr(torch.ops.mkl, "_mkl_linear") and torch.backends.mkl.is_available()


class PackedLinear(torch.nn.Module):
    def __init__(self, linear: torch.nn.Linear, max_packed_rows: int = MAX_PACKED_ROWS) -> None:
        super().__init__()
        self.max_packed_rows = max_packed_rows
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight          # kept (shared, e.g. a tied embedding); the pack is extra
        self.bias = linear.bias
        with torch.no_grad():
            self.register_buffer("packed", torch.ops.mkl._mkl_reorder_linear_weight(self.weight.detach(),
                                                                                  PACK_ROWS_HINT),
                                 persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] > self.max_packed_rows:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        out = torch.ops.mkl._mkl_linear(rows, self.packed, self.weight, self.bias, rows.shape[0])
        return out.view(*x.shape[:-1], self.out_features)


def pack_linears(module: torch.nn.Module, max_packed_rows: int = MAX_PACKED_ROWS) -> int:
    """Replaces every float32 nn.Linear under `module` by a PackedLinear; returns how many."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, torch.nn.Linear) and child.weight.dtype == torch.float32:
            setattr(module, name, PackedLinear(child, max_packed_rows))
            count += 1
        else:
            count += pack_linears(child, max_packed_rows)
    return count
