"""The gathered low-rank update of a mixed batch (punica / S-LoRA style, in torch: CPU and CUDA).

Every attention and MLP projection of the model is wrapped once in a `LoraLinear` that calls the
module it wraps (a packed, coded or plain linear: the base GEMM stays one shared call over all
rows of the step) and then, only in a step that carries adapter rows, adds each adapter's
update to its own rows: `y[rows] += scale * (x[rows] @ A^T) @ B^T`, one pair of small GEMMs per
adapter present in the step, its rows a slice when they are contiguous, else gathered and
scattered back with index_select / index_add_. A step without adapter rows costs one attribute
read per projection.

`LoraRows` is the step's grouping of rows by adapter; `LoraStep` holds it while the forward
runs (set and cleared by forward.py), shared by every wrapper of the model.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from services.worker.engine.lora.peft_adapter import PROJECTIONS, LoraAdapter
from services.worker.engine.lora.stacked import Stack, stacked_update

Rows = slice | torch.Tensor


STACKED_MAX_ROWS = 256     # steps up to this many rows with several adapters take the stacked update


@dataclass
class LoraRows:
    groups: tuple[tuple[LoraAdapter, Rows], ...]     # each adapter of the step and its rows
    slots: list[int]                                 # per row: its adapter's index in `adapters`, -1 the base
    device: torch.device
    masks: dict[tuple, torch.Tensor] = field(default_factory=dict)   # the stacked update's, per layout

    @property
    def adapters(self) -> tuple[LoraAdapter, ...]:
        return tuple(adapter for adapter, _ in self.groups)

    @property
    def stacked(self) -> bool:
        """Whether the step takes the stacked update (stacked.py): several adapters over few rows."""
        return len(self.groups) > 1 and len(self.slots) <= STACKED_MAX_ROWS

    @classmethod
    def of(cls, runs: Sequence[tuple[LoraAdapter | None, int, int]], device: torch.device) -> LoraRows | None:
        """The grouping of runs (adapter or None for the base, first row, row count) in row
        order; None when no run has an adapter."""
        by_adapter: dict[int, tuple[LoraAdapter, list[int]]] = {}
        slots: list[int] = []
        for adapter, start, count in runs:
            if adapter is not None and count:
                index = list(by_adapter).index(id(adapter)) if id(adapter) in by_adapter else len(by_adapter)
                by_adapter.setdefault(id(adapter), (adapter, []))[1].extend(range(start, start + count))
                slots.extend([index] * count)
            else:
                slots.extend([-1] * count)
        if not by_adapter:
            return None
        groups = []
        for adapter, rows in by_adapter.values():
            contiguous = rows[-1] - rows[0] + 1 == len(rows)
            groups.append((adapter, slice(rows[0], rows[-1] + 1) if contiguous
                           else torch.tensor(rows, dtype=torch.long, device=device)))
        return cls(tuple(groups), slots, device)


class LoraStep:
    """The rows of the step being computed, read by every LoraLinear of the model."""

    def __init__(self) -> None:
        self.rows: LoraRows | None = None

    @property
    def active(self) -> bool:
        return self.rows is not None

    @contextmanager
    def serving(self, rows: LoraRows | None) -> Iterator[None]:
        self.rows = rows
        try:
            yield
        finally:
            self.rows = None


class LoraLinear(torch.nn.Module):
    """A projection plus the low-rank updates of the step's adapters (module name `name`)."""

    def __init__(self, base: torch.nn.Module, name: str, step: LoraStep) -> None:
        super().__init__()
        self.base = base
        self.name = name
        self.in_features, self.out_features = base.in_features, base.out_features
        self._step = step
        self._stack: Stack | None = None      # the stacked weights of the last adapter set (stacked.py)

    @property
    def weight(self) -> torch.Tensor | None:
        return getattr(self.base, "weight", None)

    @property
    def bias(self) -> torch.Tensor | None:
        return getattr(self.base, "bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        rows = self._step.rows
        if rows is None:
            return out
        if not out.is_contiguous():
            out = out.contiguous()
        flat_in, flat_out = x.reshape(-1, self.in_features), out.view(-1, self.out_features)
        if rows.stacked:
            self._stack = stacked_update(self.name, rows, self._stack, flat_in, flat_out)
            return out
        for adapter, selected in rows.groups:
            weights = adapter.weights.get(self.name)
            if weights is None:
                continue
            if isinstance(selected, slice):
                low = flat_in[selected] @ weights.a.t()
                flat_out[selected].addmm_(low, weights.b.t(), alpha=weights.scale)
            else:
                low = flat_in.index_select(0, selected) @ weights.a.t()
                flat_out.index_add_(0, selected, low @ weights.b.t(), alpha=weights.scale)
        return out


def wrap_projections(model: torch.nn.Module, step: LoraStep) -> dict[str, tuple[int, int]]:
    """Wraps every attention and MLP projection of `model` (by its name in model.named_modules())
    in a LoraLinear; returns name -> (in_features, out_features) of each."""
    shapes: dict[str, tuple[int, int]] = {}

    def wrap(prefix: str, module: torch.nn.Module) -> None:
        for child_name, child in list(module.named_children()):
            name = f"{prefix}{child_name}"
            if (child_name in PROJECTIONS and not isinstance(child, LoraLinear)
                    and hasattr(child, "in_features") and hasattr(child, "out_features")):
                setattr(module, child_name, LoraLinear(child, name, step))
                shapes[name] = (int(child.in_features), int(child.out_features))
            else:
                wrap(f"{name}.", child)

    wrap("", model)
    return shapes


