"""N-gram speculation (prompt lookup): draft tokens copied from earlier in the
sequence itself, verified in the same forward as the decode.

When the last n tokens (n from max_n down to min_n) occurred before, the
tokens that followed their latest earlier occurrence are proposed. The engine
then runs the decode token and the drafts as one chunk, samples every row as
if the drafts were already part of the sequence, and keeps the drafts up to
the first one the sampler did not pick, plus the token sampled at that row.
Each row's draw is what plain decoding would draw given the same history, so
the text is the same as without speculation: for greedy rows exactly, for
seeded rows draw for draw, for unseeded rows in distribution.
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramIndex:
    """Latest end position of every n-gram (min_n <= n <= max_n) of one growing
    token sequence, indexed incrementally as the sequence grows."""

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min ({min_n}) <= max ({max_n})")
        self.min_n = min_n
        self.max_n = max_n
        self._ends: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        self._next_end = 1      # the next end position to index; every end is < len(tokens)

    def propose(self, tokens: Sequence[int], max_tokens: int) -> list[int]:
        """Up to `max_tokens` tokens that followed the latest earlier occurrence of the
        longest suffix of `tokens` seen before; [] when none was."""
        if max_tokens <= 0:
            return []
        self._catch_up(tokens)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            end = self._ends[n].get(tuple(tokens[len(tokens) - n:]))
            if end is not None:
                return list(tokens[end:end + max_tokens])
        return []

    def _catch_up(self, tokens: Sequence[int]) -> None:
        # An n-gram ending at `end` is indexed once tokens[end] (its continuation) exists.
        for end in range(self._next_end, len(tokens)):
            for n, ends in self._ends.items():
                if end >= n:
                    ends[tuple(tokens[end - n:end])] = end
        self._next_end = max(self._next_end, len(tokens))


def accepted_prefix(drafts: Sequence[int], sampled: Sequence[int]) -> list[int]:
    """The tokens a verified chunk emits: `sampled[i]` is the token drawn at the row
    after drafts[:i]; drafts are kept while the draw agrees, and the first draw that
    does not (or the one after the last draft) ends the run."""
    emitted: list[int] = []
    for index, token in enumerate(sampled):
        emitted.append(token)
        if index >= len(drafts) or token != drafts[index]:
            break
    return emitted
