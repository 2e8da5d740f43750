"""The stacked LoRA update of a step with several adapters over few rows (decode steps).

Grouping rows by adapter costs a handful of small torch calls per adapter per projection: with
16 adapters in a 32-row decode step that is ~2,000 calls a step. Stacked, every adapter's A of a
projection is one [in, R] matrix and every B one [R, out] (R the sum of their ranks): the step's
rows go through all of them in two GEMMs, `((x @ A_all^T) * mask) @ B_all`, where the mask keeps,
for each row, its own adapter's columns multiplied by that adapter's scale and zeros elsewhere
(base rows: all zeros). Masked columns add exact zeros, so each row gets its own adapter's update.
The extra work (every row through every adapter's A) is R / out of the base GEMM per row, small
for the few rows this serves (layers.STACKED_MAX_ROWS).

A projection keeps the stack of the last adapter set it served (a decode batch keeps its set for
many steps); the masks are built once per step for each layout of ranks and scales.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from services.worker.engine.lora.layers import LoraRows
    from services.worker.engine.lora.peft_adapter import LoraAdapter

Layout = tuple[tuple[int, int, int, float], ...]   # (adapter index, first column, rank, scale)


@dataclass(frozen=True)
class Stack:
    key: tuple[int, ...]                 # ids of the adapters, in the step's order
    adapters: tuple[LoraAdapter, ...]    # held, so that the ids stay theirs
    a_t: torch.Tensor                    # [in, R]
    b: torch.Tensor                      # [R, out]
    layout: Layout


def build_stack(name: str, adapters: tuple[LoraAdapter, ...]) -> Stack | None:
    """The stacked weights of projection `name` over `adapters` (None: none of them targets it)."""
    layout, a_parts, b_parts, column = [], [], [], 0
    for index, adapter in enumerate(adapters):
        weights = adapter.weights.get(name)
        if weights is None:
            continue
        rank = weights.a.shape[0]
        layout.append((index, column, rank, weights.scale))
        a_parts.append(weights.a)
        b_parts.append(weights.b.t())
        column += rank
    if not layout:
        return None
    return Stack(tuple(map(id, adapters)), adapters, torch.cat(a_parts).t().contiguous(),
                 torch.cat(b_parts).contiguous(), tuple(layout))


def row_mask(rows: LoraRows, layout: Layout, columns: int) -> torch.Tensor:
    """[rows, columns]: each row's adapter's columns at its scale, zeros elsewhere (cached per step)."""
    mask = rows.masks.get(layout)
    if mask is None:
        scale_of = {index: (start, rank, scale) for index, start, rank, scale in layout}
        values = torch.zeros(len(rows.slots), columns)
        for row, slot in enumerate(rows.slots):
            found = scale_of.get(slot)
            if found is not None:
                start, rank, scale = found
                values[row, start:start + rank] = scale
        mask = rows.masks[layout] = values.to(rows.device)
    return mask


def stacked_update(name: str, rows: LoraRows, stack: Stack | None, flat_in: torch.Tensor,
                   flat_out: torch.Tensor) -> Stack | None:
    """Adds every row's adapter update to `flat_out` in place; returns the stack to keep."""
    adapters = rows.adapters
    if stack is None or stack.key != tuple(map(id, adapters)):
        stack = build_stack(name, adapters)
    if stack is None:
        return None
    mask = row_mask(rows, stack.layout, stack.a_t.shape[1])
    low = torch.mm(flat_in, stack.a_t.to(flat_in.dtype)).mul_(mask.to(flat_in.dtype))
    flat_out.addmm_(low, stack.b.to(flat_in.dtype))
    return stack
