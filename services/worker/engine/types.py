"""The engine's own plain values: block events, engine info, pool listeners (the step contract
in and out of Engine.step is common/step.py); the worker's convert.py maps them to protobuf."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class StaleEpoch(ValueError):
    """A step of an older scheduler registration than the one the worker serves
    (StepBatch.epoch): refused, nothing changed."""


STORED = "stored"
REMOVED = "removed"
CLEARED = "cleared"


@dataclass(frozen=True)
class BlockEvent:
    kind: str                          # STORED | REMOVED | CLEARED
    hashes: tuple[int, ...] = ()       # STORED: in prefix order
    parent_hash: int = 0               # STORED: hash of the block before hashes[0] (0 = root)
    partial_hash: int = 0              # STORED: a whole prompt's partial last block after the chain

    @staticmethod
    def stored(hashes: list[int], parent_hash: int, partial_hash: int = 0) -> BlockEvent:
        return BlockEvent(STORED, tuple(hashes), parent_hash, partial_hash)

    @staticmethod
    def removed(hashes: list[int]) -> BlockEvent:
        return BlockEvent(REMOVED, tuple(hashes))

    @staticmethod
    def cleared() -> BlockEvent:
        return BlockEvent(CLEARED)


@dataclass(frozen=True)
class EngineInfo:
    model_name: str
    block_size: int
    num_blocks: int
    device: str
    dtype: str
    max_model_len: int
    eos_token_ids: list[int]
    vocab_size: int


class PoolListener(Protocol):
    """What follows a block pool's blocks (sliding_blocks.py): told when a block is handed
    out for new tokens, and when a sequence's table loses entries."""

    def block_reused(self, block: int) -> None: ...

    def table_changed(self, seq_id: str, table: Sequence[int]) -> None: ...
