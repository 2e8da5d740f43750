"""Stop strings matched on the detokenized text stream.

Text that could be the beginning of a stop string is held back until the next
delta decides it, so a stop string split across tokens is still found and
never reaches the client.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StopCheck:
    text: str       # safe to emit now
    stopped: bool   # a stop string matched; text ends right before it


class StopStringMatcher:
    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = tuple(stop for stop in stops if stop)
        self._held = ""
        self._stopped = False

    def feed(self, delta: str) -> StopCheck:
        if self._stopped:
            return StopCheck("", True)
        buffer = self._held + delta
        match_at = self._earliest_match(buffer)
        if match_at is not None:
            self._held = ""
            self._stopped = True
            return StopCheck(buffer[:match_at], True)
        keep = self._longest_partial_suffix(buffer)
        self._held = buffer[len(buffer) - keep:] if keep else ""
        return StopCheck(buffer[:len(buffer) - keep], False)

    def flush(self) -> str:
        """The held-back text once the stream has ended without a match."""
        held, self._held = self._held, ""
        return "" if self._stopped else held

    def _earliest_match(self, buffer: str) -> int | None:
        positions = [index for stop in self._stops if (index := buffer.find(stop)) >= 0]
        return min(positions) if positions else None

    def _longest_partial_suffix(self, buffer: str) -> int:
        """Length of the longest suffix of buffer that is a proper prefix of a stop."""
        best = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(buffer)), best, -1):
                if buffer.endswith(stop[:length]):
                    best = length
                    break
        return best
