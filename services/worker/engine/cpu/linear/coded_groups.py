"""Weights that one C call reads together: a layer's q, k and v codes side by side in memory,
and its gate and up codes, so that the C decode layers (native/decode_layers.c) run each group
as one linear instead of two or three.

A linear from codes streams its weight once a step, and at one row it is bound by that stream:
every call starts a new one (and waits for both threads at its end). Joined, the default model's
126 projections a step are 72 calls over the same bytes; in a C harness at one row 0.91-0.94x
the time, at 2-10 rows 0.96-0.98x (2-core AMD EPYC Zen 4). Each output is computed as before:
the coded kernel computes every panel of 32 output rows on its own, whichever call it is in, so
the outputs are the same bits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from services.worker.engine.cpu.linear.cpu_linear import PackedLinear
from services.worker.engine.cpu.linear.weight_codes import PANEL, CodedWeight


def read_together(linears: Sequence[PackedLinear]) -> CodedWeight | None:
    """The linears' codes as one weight whose panels are theirs in order, their own `coded`
    becoming views of it (so the bytes are held once), when they share their input width, group
    and code width and each fills whole panels; else None, and they are left as they are.

    Args:
        linears: linears over the same input whose weights are codes (`PackedLinear.coded`).

    Returns:
        The joined weight ([sum of out_features, in]), or None.
    """
    weights = [linear.coded for linear in linears]
    if len(weights) < 2 or any(weight is None for weight in weights):
        return None
    first = weights[0]
    if any(weight.in_features != first.in_features or weight.group != first.group or weight.bits != first.bits
           or weight.out_features % PANEL for weight in weights):
        return None
    joined = CodedWeight(torch.cat([weight.codes for weight in weights]),
                         torch.cat([weight.scales for weight in weights]),
                         torch.cat([weight.offsets for weight in weights]),
                         first.group, sum(weight.out_features for weight in weights), first.in_features, first.bits)
    start = 0
    for linear, weight in zip(linears, weights):
        linear.coded = joined.panel_rows(start, start + weight.out_features)
        start += weight.out_features
    return joined
