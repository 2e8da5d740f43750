"""`python -m benchmarks.ab_stacks --prefix`: the prefix bench's first tokens
(benchmarks/prefix_cache_bench.py) on two stacks that are up at once, request by request
alternating, so a millisecond of difference shows through the host's drift.

Each round is a new document of ~1,496 tokens (120 with --quick): cold on both stacks, then
`variants` warm prompts (the same document, another last sentence each) and `variants // 2`
identical ones, each sent to one stack and then the other, the order flipping from request to
request. Reports each side's medians, its cold / warm and cold / identical ratios, and the
warm TTFT's ratio B / A paired by round.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

import httpx

from benchmarks.prefix_cache_bench import first_token, last_sentence, long_body

KINDS = ("cold", "warm", "exact")


@dataclass
class PrefixTimes:
    """One side's TTFTs (ms) by kind: cold, warm prefix, identical."""
    ms: dict[str, list[float]] = field(default_factory=lambda: {kind: [] for kind in KINDS})

    def median(self, kind: str) -> float:
        return statistics.median(self.ms[kind])


def prefix_round(urls: tuple[str, str], clients: tuple[httpx.Client, httpx.Client], tokenizer: Any,
                 document: int, prompt_tokens: int, variants: int) -> tuple[PrefixTimes, PrefixTimes]:
    """One document's first tokens on both stacks (A first in even documents)."""
    times = (PrefixTimes(), PrefixTimes())
    body = long_body(tokenizer, document, prompt_tokens)

    def send(which: int, kind: str, prompt: str) -> None:
        times[which].ms[kind].append(first_token(clients[which], urls[which], prompt, None).ttft_s * 1e3)

    first = (0, 1) if document % 2 == 0 else (1, 0)
    for which in first:
        send(which, "cold", body + last_sentence(0))
    for index in range(variants):
        for which in first if index % 2 == 0 else first[::-1]:
            send(which, "warm", body + last_sentence(index + 1))
    for index in range(max(1, variants // 2)):
        for which in first if index % 2 == 0 else first[::-1]:
            send(which, "exact", body + last_sentence(0))
    return times


def prefix_summary(names: tuple[str, str], rounds: list[tuple[PrefixTimes, PrefixTimes]]) -> list[str]:
    """Each side's medians over every round's requests and their ratios, then the warm TTFT's
    B / A, round by round."""
    lines = []
    for which, name in enumerate(names):
        merged = PrefixTimes()
        for pair in rounds:
            for kind in KINDS:
                merged.ms[kind] += pair[which].ms[kind]
        cold, warm, exact = (merged.median(kind) for kind in KINDS)
        lines.append(f"{name}: cold {cold:,.1f} ms, warm prefix {warm:.2f} ms, identical {exact:.2f} ms "
                     f"(medians of {len(merged.ms['cold'])}, {len(merged.ms['warm'])}, {len(merged.ms['exact'])}); "
                     f"cold / warm prefix {cold / warm:.1f}x, cold / identical {cold / exact:.1f}x")
    ratios = [b.median("warm") / a.median("warm") for a, b in rounds]
    faster = sum(1 for ratio in ratios if ratio < 1)
    lines.append(f"B / A warm-prefix TTFT, paired by round: median {statistics.median(ratios):.3f} "
                 f"({min(ratios):.3f}-{max(ratios):.3f}; B faster in {faster} of {len(ratios)}): "
                 f"{' '.join(f'{ratio:.3f}' for ratio in ratios)}")
    return lines
