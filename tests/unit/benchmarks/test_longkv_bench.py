"""make bench-longkv's script in its quick mode (tiny random model): every policy and budget
scored over the whole text, lossy ones within their budgets, the report written."""

from __future__ import annotations

import json
import math
from pathlib import Path

from benchmarks.longkv_bench import main


def test_quick_mode_scores_every_policy(tmp_path: Path, capsys) -> None:
    main(["--quick", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "results.json").read_text())
    rows = report["perplexity"]
    assert [(row["policy"], row["budget"]) for row in rows][:4] == [
        ("full", 0), ("window", 128), ("sink", 128), ("h2o", 128)]
    assert len(rows) == 7 and all(math.isfinite(row["perplexity"]) for row in rows)
    for row in rows[1:]:
        assert row["most_blocks"] <= row["budget"] // 4
    assert rows[0]["most_blocks"] == -(-report["tokens"] // 4)
    assert report["decode"]["sink"]["kv_bytes"] < report["decode"]["full"]["kv_bytes"]
    # The tiny model's 3 sliding layers (window 8) hold about a window; its 1 full layer, everything.
    one_cache = report["decode"]["full, one cache"]["kv_bytes"]
    assert report["decode"]["full"]["kv_bytes"] < one_cache / 3
    assert "| sink | 64 |" in capsys.readouterr().out
