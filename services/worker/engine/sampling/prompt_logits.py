"""What gives the last-position logits of recently prefilled prompts, for the
exact-match path.

An identical prompt whose K/V is still cached needs no forward through the
layers when the final hidden state of its last position is kept: that state is
a pure function of the model and the prompt's tokens, and its logits follow
through the LM head (or its screen) as for any row, whatever the new request's
sampling or logprobs. The logits rows computed from it are kept beside it, so a
later identical request whose draw reads the same rows skips the LM head too:

    KeptPrompt
      hidden     [hidden]   always
      complete   [vocab]    the full row, once a request needed it: serves any draw
      screened   {pick: (ids, values)}   a screened row's exact entries (-inf
                 elsewhere), for draws of that pick alone: the same number of best
                 tokens read, the same tokens adjusted by the sampler

Entries are keyed by the prompt's last full block hash (which chains every
earlier token) plus its trailing tokens and its sequence's cache salt (a prompt
shorter than a block chains to the root, 0, whatever its salt; a row is never
served across salts), and evicted least recently used first. One entry holds
at most one vocabulary-sized row (1 MiB on Gemma 3) besides a hidden-size one
and a few screened rows of some hundred entries, so the capacity is a count of
prompts.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

PromptKey = tuple[int, tuple[int, ...], str]
Pick = tuple[int, tuple[int, ...]]     # (best tokens a draw reads, the tokens its sampler adjusts)

MAX_SCREENED_PICKS = 4     # screened rows kept per prompt, most recent first


def prompt_key(last_full_hash: int, tail_tokens: Sequence[int], cache_salt: str = "") -> PromptKey:
    return last_full_hash, tuple(tail_tokens), cache_salt


@dataclass
class KeptPrompt:
    hidden: torch.Tensor
    complete: torch.Tensor | None = None
    screened: OrderedDict[Pick, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=OrderedDict)
    vocab_size: int = 0

    def logits_for(self, pick: Pick | None) -> torch.Tensor | None:
        """A kept row that serves a draw of `pick` (None: a draw that needs the full row)."""
        if self.complete is not None:
            return self.complete
        kept = self.screened.get(pick) if pick is not None else None
        if kept is None:
            return None
        ids, values = kept
        row = torch.full((self.vocab_size,), float("-inf"), dtype=values.dtype)
        row[ids] = values
        return row

    def keep_logits(self, row: torch.Tensor, pick: Pick | None) -> None:
        """Keeps a copy of a row computed from `hidden`: complete (`pick` None), or screened
        for `pick` (its finite entries only)."""
        if pick is None:
            self.complete = row.detach().clone()
            self.screened.clear()
            self.vocab_size = row.shape[0]
            return
        if self.complete is not None:
            return
        ids = _finite_entries(row.detach())
        self.screened[pick] = (ids, row[ids].detach().clone())
        self.screened.move_to_end(pick)
        self.vocab_size = row.shape[0]
        while len(self.screened) > MAX_SCREENED_PICKS:
            self.screened.popitem(last=False)


def _finite_entries(row: torch.Tensor) -> torch.Tensor:
    """Indices of `row`'s finite entries, ascending. On CPU through numpy's `flatnonzero`: on a
    screened 262k-entry row (a handful of finite entries) ~50 us against ~330 us for torch's
    isfinite + nonzero, once per prompt's last row."""
    if row.device.type == "cpu":
        return torch.from_numpy(np.flatnonzero(np.isfinite(row.numpy())))
    return torch.nonzero(torch.isfinite(row)).flatten()


class PromptLogitsCache:
    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._rows: OrderedDict[PromptKey, KeptPrompt] = OrderedDict()
        self.hits = 0

    def __len__(self) -> int:
        return len(self._rows)

    def contains(self, key: PromptKey) -> bool:
        return key in self._rows

    def get(self, key: PromptKey) -> KeptPrompt | None:
        kept = self._rows.get(key)
        if kept is not None:
            self._rows.move_to_end(key)
            self.hits += 1
        return kept

    def put(self, key: PromptKey, hidden_row: torch.Tensor) -> KeptPrompt:
        """Keeps a private copy of `hidden_row` ([hidden]) under `key`; returns its entry
        (the one already there when the prompt is kept: the same state)."""
        kept = self._rows.get(key)
        if kept is None:
            kept = KeptPrompt(hidden_row.detach().clone())
            if self.capacity:
                self._rows[key] = kept
        if self.capacity:
            self._rows.move_to_end(key)
        while len(self._rows) > self.capacity:
            self._rows.popitem(last=False)
        return kept

    def clear(self) -> None:
        self._rows.clear()
