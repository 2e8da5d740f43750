"""`python -m benchmarks.ab_stacks --quick`: two tiny-model stacks up side by side, one with a
setting of its own, each round's line for both, and the paired summary."""

from __future__ import annotations

from benchmarks.ab_stacks import main


def test_quick_ab_runs_both_stacks_in_alternating_rounds(capsys) -> None:
    assert main(["--quick", "--b-env", "HOST_MEMORY_RELEASE_ROWS=0"]) == 0
    out = capsys.readouterr().out
    rounds = [line for line in out.splitlines() if line.startswith("round ")]
    assert [line.split(":")[0] for line in rounds] == ["round 1 A", "round 1 B", "round 2 B", "round 2 A"]
    assert all("tok/s" in line and "worker" in line for line in rounds)
    assert "HOST_MEMORY_RELEASE_ROWS=0" in out and "B / A output tok/s, paired by round: median" in out


def test_quick_prefix_ab_alternates_cached_prompts_on_both_stacks(capsys) -> None:
    assert main(["--quick", "--prefix", "--b-env", "EVENT_LOOP=asyncio"]) == 0
    out = capsys.readouterr().out
    rounds = [line for line in out.splitlines() if line.startswith("round ")]
    assert [line.split(":")[0] for line in rounds] == ["round 1 A", "round 1 B", "round 2 A", "round 2 B"]
    assert all("warm prefix" in line and "identical" in line for line in rounds)
    assert "EVENT_LOOP=asyncio" in out and "B / A warm-prefix TTFT, paired by round: median" in out
