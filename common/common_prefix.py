"""The length of the longest common start of two sequences (token ids, texts)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def common_prefix_len(left: Sequence[Any], right: Sequence[Any]) -> int:
    """Length of the longest common prefix (binary search over slice comparisons,
    which run in C: O(n log n) element comparisons, no Python loop per element)."""
    low, high = 0, min(len(left), len(right))
    while low < high:
        middle = (low + high + 1) // 2
        if left[:middle] == right[:middle]:
            low = middle
        else:
            high = middle - 1
    return low
