"""Chained block hashes, shared by workers, the KV index and the scheduler.

A full block of `block_size` tokens is identified by hash(parent, tokens,
model), so equal hashes mean equal prefixes. Hashes are 63-bit unsigned so
they fit protobuf uint64 and Redis integers alike. 0 is the root's hash.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

ROOT_HASH = 0
_MASK = (1 << 63) - 1


def block_hash(parent: int, tokens: Sequence[int], model_key: str = "") -> int:
    digest = hashlib.blake2b(digest_size=8)
    digest.update(struct.pack("<Q", parent))
    digest.update(model_key.encode())
    digest.update(struct.pack(f"<{len(tokens)}i", *tokens))
    value = int.from_bytes(digest.digest(), "little") & _MASK
    return value or 1


def chain_hashes(tokens: Sequence[int], block_size: int, model_key: str = "",
                 parent: int = ROOT_HASH) -> list[int]:
    """Hashes of every *full* block of `tokens`, in prefix order."""
    hashes: list[int] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = block_hash(parent, tokens[start:start + block_size], model_key)
        hashes.append(parent)
    return hashes
