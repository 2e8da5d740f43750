"""Last-position logits of recently prefilled prompts, for the exact-match path.

An identical prompt whose K/V is still cached needs no forward at all when the
logits of its last position are kept too: they are a pure function of the
model and the prompt's tokens. Entries are keyed by the prompt's last full
block hash (which chains every earlier token) plus its trailing tokens and its
sequence's cache salt (a prompt shorter than a block chains to the root, 0,
whatever its salt; a row is never served across salts), and evicted least
recently used first. One entry is one vocabulary-sized row
(1 MiB on Gemma 3), so the capacity is a count of prompts.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

PromptKey = tuple[int, tuple[int, ...], str]


def prompt_key(last_full_hash: int, tail_tokens: Sequence[int], cache_salt: str = "") -> PromptKey:
    return last_full_hash, tuple(tail_tokens), cache_salt


class PromptLogitsCache:
    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._rows: OrderedDict[PromptKey, torch.Tensor] = OrderedDict()
        self.hits = 0

    def __len__(self) -> int:
        return len(self._rows)

    def contains(self, key: PromptKey) -> bool:
        return key in self._rows

    def get(self, key: PromptKey) -> torch.Tensor | None:
        row = self._rows.get(key)
        if row is not None:
            self._rows.move_to_end(key)
            self.hits += 1
        return row

    def put(self, key: PromptKey, logits_row: torch.Tensor) -> None:
        """Keeps a private copy of `logits_row` ([vocab]) under `key`."""
        if self.capacity == 0:
            return
        self._rows[key] = logits_row.detach().clone()
        self._rows.move_to_end(key)
        while len(self._rows) > self.capacity:
            self._rows.popitem(last=False)

    def clear(self) -> None:
        self._rows.clear()
