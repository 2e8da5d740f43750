"""Rounds and peer tuning for the head-to-head: the order systems run in each round (A B, then
B A: a slow drift of the machine, another tenant's load or thermal, falls on every system
alike), the median of each point over the rounds, each peer's best documented configuration
(--tune-peers), and the ratios the report quotes."""

from __future__ import annotations

from dataclasses import replace

from benchmarks.head_to_head.report import Point


def round_order(systems: list[str], round_index: int) -> list[str]:
    """The systems in run order for round `round_index` (0-based): as given, then reversed."""
    return list(systems) if round_index % 2 == 0 else list(reversed(systems))


def median_points(rounds: list[list[Point]]) -> list[Point]:
    """Per system and point, the round whose output tok/s is the median (the lower one of an
    even count), carrying every round's tok/s; points in first-round order."""
    by_key: dict[tuple[str, str, float], list[Point]] = {}
    for points in rounds:
        for p in points:
            by_key.setdefault((p.system, p.kind, p.x), []).append(p)
    chosen = []
    for runs in by_key.values():
        ranked = sorted(runs, key=lambda p: p.output_tokens_per_s)
        middle = ranked[(len(ranked) - 1) // 2]
        chosen.append(replace(middle, round_tokens_per_s=tuple(p.output_tokens_per_s for p in runs)))
    return chosen


def best_tuning(trials: dict[str, float]) -> str:
    """The tuning with the most output tok/s (the first listed on a tie)."""
    return max(trials, key=lambda name: trials[name])


def ratio_lines(points: list[Point], ours: str = "fairserve") -> list[str]:
    """At each closed-loop point: our median output tok/s against the best peer's, and against
    each peer's, with each side's rounds."""
    lines = []
    for x in sorted({p.x for p in points if p.kind == "concurrency"}):
        at = {p.system: p for p in points if p.kind == "concurrency" and p.x == x}
        if ours not in at or len(at) < 2:
            continue
        peers = {name: p for name, p in at.items() if name != ours and p.output_tokens_per_s > 0}
        if not peers:
            continue
        best = max(peers.values(), key=lambda p: p.output_tokens_per_s)
        mine = at[ours].output_tokens_per_s
        each = ", ".join(f"{name} {mine / p.output_tokens_per_s:.2f}x" for name, p in peers.items())
        lines.append(f"concurrency {x:g}: {ours} {mine:.1f} tok/s = {mine / best.output_tokens_per_s:.2f}x the "
                     f"best peer ({best.system}, {best.output_tokens_per_s:.1f}); {each}"
                     f" (rounds: {_rounds(at[ours])} against {_rounds(best)}){_tpot(at[ours], peers)}")
    return lines


def _tpot(mine: Point, peers: dict[str, Point]) -> str:
    """Our TPOT p50 against each peer's (lower is better), each its median round's."""
    theirs = {name: p.tpot_p50_ms for name, p in peers.items() if p.tpot_p50_ms}
    if not mine.tpot_p50_ms or not theirs:
        return ""
    each = ", ".join(f"{mine.tpot_p50_ms / ms:.2f}x {name}'s {ms:.2f}" for name, ms in theirs.items())
    return f"; TPOT p50 {mine.tpot_p50_ms:.2f} ms = {each}"


def _rounds(p: Point) -> str:
    return "/".join(f"{v:.1f}" for v in p.round_tokens_per_s or (p.output_tokens_per_s,))
