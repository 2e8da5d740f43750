"""`make bench-serving`'s quick mode: the tiny model on the whole fairserve stack
through every point of the sweep (closed loop, Poisson rates, the chat-like
mix), the peers that are not set up skipped with their line, and the JSON,
table and PNG curves written."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.head_to_head.__main__ import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_quick_mode_writes_results_table_and_curves(tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    code = main(["--quick", "--systems", "fairserve,vllm,llama.cpp", "--peers-dir", str(tmp_path / "no-peers"),
                 "--out", str(out)])
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    assert results["meta"]["systems"] == ["fairserve"]
    assert "not set up" in results["skipped"]["vllm"] and "no GGUF" in results["skipped"]["llama.cpp"]
    points = results["points"]
    assert [(p["kind"], p["x"]) for p in points] == [("concurrency", 1), ("concurrency", 4), ("rate", 2.0),
                                                     ("rate", 8.0), ("chat", 2)]
    for p in points:
        assert p["ok"] == p["sent"] > 0, p
        assert p["wrong_length"] == 0, p                      # every answer as long as asked for
        assert p["output_tokens_per_s"] > 0 and p["ttft_p50_ms"] is not None, p
    chat = points[-1]
    assert chat["sent"] > 3                                   # conversations went past their first turn
    assert chat["cached_prompt_fraction"] > 0                 # later turns reuse the conversation's prefix
    table = (out / "table.md").read_text()
    assert "| 1 in flight | fairserve | 2 / 2 |" in table
    assert "- vllm: skipped: not set up" in table and "- llama.cpp: skipped:" in table
    assert "- fairserve settings: " in table and results["meta"]["rounds"] == 1   # --quick: one round
    assert results["meta"]["settings"]["fairserve"]
    for name in ("throughput_vs_concurrency", "ttft_vs_rate", "tpot_vs_rate", "goodput_vs_rate"):
        assert (out / f"{name}.png").read_bytes().startswith(PNG_MAGIC)
    assert "| chat, 2 users | fairserve |" in capsys.readouterr().out
