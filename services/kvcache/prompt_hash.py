"""Hashes of a whole prompt: its full blocks plus its partial last block.

The partial block is hashed like a full one, chained to the last full block,
so its hash identifies the entire prompt. Workers publish it (the exact-match
fast path) and lookups by token ids compute the same value.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from common.block_hash import ROOT_HASH, block_hash, chain_hashes


@dataclass(frozen=True)
class PromptHashes:
    block_hashes: tuple[int, ...]
    partial_hash: int     # 0 when the prompt ends on a block boundary
    partial_tokens: int


def partial_block_hash(parent: int, tail_tokens: Sequence[int], model_key: str = "") -> int:
    return block_hash(parent, tail_tokens, model_key) if tail_tokens else 0


def prompt_hashes(tokens: Sequence[int], block_size: int, model_key: str = "") -> PromptHashes:
    blocks = chain_hashes(tokens, block_size, model_key)
    tail = tokens[len(blocks) * block_size:]
    parent = blocks[-1] if blocks else ROOT_HASH
    return PromptHashes(tuple(blocks), partial_block_hash(parent, tail, model_key), len(tail))
