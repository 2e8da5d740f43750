"""The LoRA tables of the C decode layers (native/decode_layers.c's lora_t): for each layer and
projection, the step's adapters' A and B^T pointers, ranks and scales, so that a decode step
with adapter rows stays in the one C call (the update added row by row after each projection).

Built once per set of adapters (a decode batch keeps its set for many steps) and kept with the
tensors they point into; a step then only passes its rows' adapter slots.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from services.worker.engine.lora.layers import LoraRows

PROJECTION_ORDER = ("q", "k", "v", "o", "gate", "up", "down")   # decode_layers.c's enum


class _Lora(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in ("a", "b_t", "ranks", "scales")]


class LoraTables:
    """Every layer's lora_t[7] for one set of adapters, and the scratch the C update needs."""

    def __init__(self, names: list[tuple[str, ...]], rows: LoraRows) -> None:
        adapters = rows.adapters
        self.key = tuple(map(id, adapters))
        self._adapters = adapters                    # held, so that the ids and pointers stay theirs
        self.max_rank = max(adapter.rank for adapter in adapters)
        count = len(adapters)
        self._keep: list[object] = []
        self.layers: list[ctypes.Array] = []
        for layer_names in names:
            tables = (_Lora * len(PROJECTION_ORDER))()
            for table, name in zip(tables, layer_names):
                weights = [adapter.weights.get(name) for adapter in adapters]
                a = (ctypes.c_void_p * count)(*[w.a.data_ptr() if w is not None else None for w in weights])
                b_t = (ctypes.c_void_p * count)(*[w.b_t.data_ptr() if w is not None else None for w in weights])
                ranks = torch.tensor([w.a.shape[0] if w is not None else 0 for w in weights], dtype=torch.int64)
                scales = torch.tensor([w.scale if w is not None else 0.0 for w in weights], dtype=torch.float32)
                table.a, table.b_t = ctypes.addressof(a), ctypes.addressof(b_t)
                table.ranks, table.scales = ranks.data_ptr(), scales.data_ptr()
                self._keep.extend((a, b_t, ranks, scales))
            self.layers.append(tables)

    def matches(self, rows: LoraRows) -> bool:
        return self.key == tuple(map(id, rows.adapters))

    @staticmethod
    def slots(rows: LoraRows) -> torch.Tensor:
        return torch.tensor(rows.slots, dtype=torch.int64)
