"""Replaces submodules of a model in place by equivalents that compute the same faster."""

from __future__ import annotations

from collections.abc import Callable

import torch


def swap_modules(module: torch.nn.Module, replacement: Callable[[torch.nn.Module], torch.nn.Module | None]) -> int:
    """Replaces every submodule for which `replacement` returns a module (its own children are
    then left alone) and recurses into the others; returns how many were replaced."""
    count = 0
    for name, child in list(module.named_children()):
        swapped = replacement(child)
        if swapped is not None:
            setattr(module, name, swapped)
            count += 1
        else:
            count += swap_modules(child, replacement)
    return count
