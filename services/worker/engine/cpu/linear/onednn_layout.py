"""Where oneDNN's float32 linear pack puts each weight entry, learned on this CPU.

oneDNN reorders a plain [out, in] weight into a blocked layout of its own before its GEMM
(torch.ops.mkldnn._reorder_linear_weight). On the CPUs measured that layout is a plain
permutation, [out / B][in][B] with B = 64 on AVX-512: entry (n, k) at ((n // B) * in + k)
* B + n % B, no padding, no other transformation. Knowing it, a caller can write a pack
itself (coded_wide.py writes one straight from a weight's codes) and hand it to oneDNN's
linear, which then runs exactly as on its own pack.

The layout is not assumed: `learn` packs a weight whose every entry is its own index
(exact in float32 up to 2^24 entries) and reads the pack's bytes back; a shape whose pack is
anything but such a permutation (padding, another order, another format on another CPU or
oneDNN version) gets None, and the caller keeps oneDNN's own reorder.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

MAX_ENTRIES = 2 ** 24      # indexes stay exact in float32 up to here


@dataclass(frozen=True)
class BlockedPack:
    """A oneDNN float32 pack of an [out, in] weight in the layout [out / block][in][block]:
    `tensor` is the (opaque) pack, `address` its bytes, which callers may overwrite."""
    tensor: torch.Tensor
    address: int
    block: int


def pack_bytes_readable() -> bool:
    mkldnn = getattr(torch.ops, "mkldnn", None)
    return (mkldnn is not None and torch.backends.mkldnn.is_available()
            and all(hasattr(mkldnn, name) for name in ("_reorder_linear_weight", "data_ptr", "_nbytes")))


def learn(out_features: int, in_features: int, rows_hint: int) -> BlockedPack | None:
    """A pack of an [out, in] float32 weight (packed for `rows_hint` rows, as the packs it
    stands in for) whose layout is checked to be [out / block][in][block], or None."""
    entries = out_features * in_features
    if not pack_bytes_readable() or entries > MAX_ENTRIES or in_features < 2:
        return None
    index = torch.arange(entries, dtype=torch.float32).view(out_features, in_features)
    pack = torch.ops.mkldnn._reorder_linear_weight(index, rows_hint)
    if int(torch.ops.mkldnn._nbytes(pack)) != entries * 4:
        return None
    address = int(torch.ops.mkldnn.data_ptr(pack))
    placed = torch.frombuffer((ctypes.c_float * entries).from_address(address), dtype=torch.float32)
    second = (placed == 1).nonzero()          # where entry (0, 1) went: one block past (0, 0)
    block = int(second[0]) if len(second) == 1 else 0
    if block <= 0 or out_features % block:
        return None
    expected = index.view(out_features // block, block, in_features).transpose(1, 2).reshape(-1)
    if not torch.equal(placed, expected):
        return None
    return BlockedPack(pack, address, block)


def bytes_of(pack: torch.Tensor) -> bytes:
    """A oneDNN pack's bytes."""
    return ctypes.string_at(int(torch.ops.mkldnn.data_ptr(pack)), int(torch.ops.mkldnn._nbytes(pack)))


def pack_of(weight: torch.Tensor, rows_hint: int) -> bytes:
    """The bytes of oneDNN's own pack of `weight` (what a written pack must equal)."""
    return bytes_of(torch.ops.mkldnn._reorder_linear_weight(weight, rows_hint))
