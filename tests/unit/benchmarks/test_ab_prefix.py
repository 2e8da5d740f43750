"""The prefix A/B's rounds and arithmetic (benchmarks/ab_prefix.py): each document cold on both
stacks, then warm and identical prompts alternating request by request with the first side
flipping, the medians and ratios of each side, and the warm TTFT's B / A paired by round.
The stacks themselves run in tests/integration/test_bench_ab.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from benchmarks import ab_prefix
from benchmarks.ab_prefix import PrefixTimes, prefix_round, prefix_summary


class _Words:
    """A tokenizer stand-in: a token a word."""

    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": list(range(len(text.split())))}


def test_a_round_sends_cold_first_then_alternates_and_flips(monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[tuple[str, str]] = []

    def fake_first_token(client, url, prompt, sink):
        kind = "cold" if prompt.endswith(ab_prefix.last_sentence(0)) and not any(
            url == u and p == prompt for u, p in sent) else "later"
        sent.append((url, prompt))
        return SimpleNamespace(ttft_s=(100.0 if kind == "cold" else 2.0) / 1e3 * (2 if url == "b" else 1))

    monkeypatch.setattr(ab_prefix, "first_token", fake_first_token)
    even = prefix_round(("a", "b"), (None, None), _Words(), 4, 40, 4)
    urls = [url for url, _ in sent]
    assert urls == ["a", "b", "a", "b", "b", "a", "a", "b", "b", "a", "a", "b", "b", "a"]
    assert [len(even[0].ms[kind]) for kind in ab_prefix.KINDS] == [1, 4, 2]
    assert even[0].median("cold") == pytest.approx(100.0) and even[1].median("warm") == pytest.approx(4.0)
    sent.clear()
    prefix_round(("a", "b"), (None, None), _Words(), 5, 40, 2)
    assert [url for url, _ in sent][:4] == ["b", "a", "b", "a"]     # odd documents: B first


def _times(cold: float, warm: list[float], exact: float) -> PrefixTimes:
    times = PrefixTimes()
    times.ms = {"cold": [cold], "warm": warm, "exact": [exact]}
    return times


def test_the_summary_gives_medians_ratios_and_paired_warm_ratios() -> None:
    rounds = [(_times(1000.0, [20.0, 22.0, 24.0], 5.0), _times(1000.0, [18.0, 20.0, 22.0], 5.0)),
              (_times(1100.0, [25.0], 6.0), _times(1100.0, [27.5], 6.0))]
    lines = prefix_summary(("A (x)", "B (y)"), rounds)
    assert lines[0].startswith("A (x): cold 1,050.0 ms, warm prefix 23.00 ms, identical 5.50 ms")
    assert "cold / warm prefix 45.7x" in lines[0] and "cold / identical 190.9x" in lines[0]
    assert lines[1].startswith("B (y): cold 1,050.0 ms, warm prefix 21.00 ms")
    assert lines[2] == ("B / A warm-prefix TTFT, paired by round: median 1.005 (0.909-1.100; B faster in 1 of 2): "
                        "0.909 1.100")
