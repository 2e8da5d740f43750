"""The load simulator against the real services (tiny model): closed loop,
an open-loop sweep, shared prefixes hitting the cache, and users hanging up
mid-stream while the server keeps serving."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from loadsim.__main__ import main
from fairserve.launcher.stack import Stack

SHARED_PREFIX = "You answer questions about the fairserve test suite, briefly and politely. " * 4


def write_workload(path: Path, disconnect_fraction: float = 0.0) -> Path:
    path.write_text(json.dumps({
        "templates": [
            {"name": "shared", "weight": 2, "prefix": SHARED_PREFIX, "prompts": ["What is this?", "Why?"],
             "max_tokens": [4, 8], "temperature": 0.7},
            {"name": "code", "weight": 1, "endpoint": "completions", "prompts": ["def add(a, b):\n"],
             "max_tokens": 6},
        ],
        "users": [{"name": "chatty", "weight": 1, "think_time_s": 0.05, "think_jitter": 0.5,
                   "disconnect_fraction": disconnect_fraction},
                  {"name": "batch", "weight": 1, "think_time_s": 0.0, "priority": 1}],
    }))
    return path


def test_closed_loop_run_records_every_request(tiny_stack: Stack, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run.json"
    code = main(["--url", tiny_stack.url, "--wait", "30", "--users", "4", "--requests", "16", "--seed", "3",
                 "--workload", str(write_workload(tmp_path / "w.json")), "--json", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "Closed loop, 4 users" in printed and "| time to first token | 16 |" in printed
    result = json.loads(out.read_text())
    records = result["records"]
    assert len(records) == 16 and result["summary"]["outcomes"] == {"ok": 16}
    assert all(1 <= r["completion_tokens"] <= 8 and r["ttft_s"] <= r["latency_s"] for r in records)
    assert {r["user"] for r in records} == {"chatty-0", "chatty-1", "batch-2", "batch-3"}
    shared = [r for r in records if r["template"] == "shared"]
    assert shared and sum(r["cached_tokens"] for r in shared) > 0     # the shared prefix hit the cache
    assert result["summary"]["output_tokens_per_s"] > 0


def test_rate_sweep_prints_one_row_per_rate(tiny_stack: Stack, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sweep.json"
    code = main(["--url", tiny_stack.url, "--rates", "4,16", "--requests", "8",
                 "--workload", str(write_workload(tmp_path / "w.json")), "--json", str(out)])
    assert code == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 4 |")
            or line.startswith("| 16 |")]
    assert len(rows) == 2
    sweep = json.loads(out.read_text())["sweep"]
    assert [row["rate"] for row in sweep] == [4.0, 16.0]
    assert all(row["outcomes"] == {"ok": 8} for row in sweep)


def test_users_hanging_up_mid_stream_leave_the_server_serving(tiny_stack: Stack, tmp_path: Path) -> None:
    out = tmp_path / "hangups.json"
    code = main(["--url", tiny_stack.url, "--users", "4", "--requests", "12",
                 "--workload", str(write_workload(tmp_path / "w.json", disconnect_fraction=1.0)),
                 "--json", str(out)])
    assert code == 0
    outcomes = json.loads(out.read_text())["summary"]["outcomes"]
    assert outcomes.get("disconnected", 0) > 0 and set(outcomes) <= {"ok", "disconnected"}
    answer = httpx.post(f"{tiny_stack.url}/v1/completions",
                        json={"prompt": "Hello", "max_tokens": 4, "temperature": 0}, timeout=60)
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] >= 1


def test_unreachable_gateway_and_bad_workload_fail_clearly(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"templates": [{"name": "x", "prompts": []}], "users": [{"name": "u"}]}))
    assert main(["--workload", str(bad), "--requests", "1"]) == 2
    assert "templates[0].prompts" in capsys.readouterr().err
    assert main(["--url", "http://127.0.0.1:9", "--requests", "1"]) == 1
    assert "cannot drive http://127.0.0.1:9" in capsys.readouterr().err
    assert main(["--url", "http://127.0.0.1:9", "--requests", "1", "--wait", "1"]) == 1
    assert "not ready after 1 s" in capsys.readouterr().err


def test_an_overload_shows_up_as_rejections_and_everything_admitted_completes(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    from tests.integration.conftest import start_stack

    stack = start_stack(tmp_path, tiny_model_dir, extra_env={"MAX_QUEUE_LEN": "2", "MAX_BATCH_SIZE": "1"})
    try:
        out = tmp_path / "overload.json"
        code = main(["--url", stack.url, "--rate", "200", "--requests", "30", "--users", "6",
                     "--workload", str(write_workload(tmp_path / "w.json")), "--json", str(out)])
        assert code == 0
        result = json.loads(out.read_text())
        outcomes = result["summary"]["outcomes"]
        assert outcomes.get("rejected", 0) > 0 and outcomes.get("ok", 0) > 0
        assert set(outcomes) <= {"ok", "rejected"}              # nothing admitted was lost
        rejected = [r for r in result["records"] if r["outcome"] == "rejected"]
        assert all(r["status"] == 429 for r in rejected)
        answer = httpx.post(f"{stack.url}/v1/completions",
                            json={"prompt": "Hello", "max_tokens": 4, "temperature": 0}, timeout=60)
        assert answer.status_code == 200
    finally:
        stack.stop()
