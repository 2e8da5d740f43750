"""The locustfile against the real services (tiny model): a few seconds of
headless Locust with two users; its CSV holds end-to-end, TTFT and TPOT rows
for the prompt kinds, and no failures."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

from fairserve.launcher.stack import Stack

ROOT = Path(__file__).resolve().parents[2]
LOCUST = Path(sys.executable).with_name("locust")


def write_workload(path: Path, talk_tokens: tuple[int, int] = (4, 8)) -> Path:
    path.write_text(json.dumps({
        "templates": [
            {"name": "talk", "weight": 2, "prefix": "You answer briefly.", "prompts": ["Hi?", "Why?"],
             "max_tokens": list(talk_tokens), "temperature": 0.7},
            {"name": "code", "weight": 1, "endpoint": "completions", "prompts": ["def add(a, b):\n"],
             "max_tokens": 6},
        ],
        "users": [{"name": "unused", "weight": 1}],
    }))
    return path


def run_locust(url: str, tmp_path: Path, *extra: str,
               talk_tokens: tuple[int, int] = (4, 8)) -> tuple[subprocess.CompletedProcess, list[dict]]:
    prefix = tmp_path / "run"
    command = [str(LOCUST), "-f", "loadsim/locustfile.py", "--headless", "-u", "2", "-r", "2", "-t", "5s",
               "--stop-timeout", "30", "--host", url, "--csv", str(prefix), "--html", str(tmp_path / "run.html"),
               "--workload", str(write_workload(tmp_path / "w.json", talk_tokens)), "--only-summary", *extra]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    stats = prefix.with_name("run_stats.csv")
    rows = list(csv.DictReader(stats.open())) if stats.exists() else []
    return done, rows


def test_locust_reports_latency_ttft_and_tpot_per_prompt_kind(tiny_stack: Stack, tmp_path: Path) -> None:
    done, rows = run_locust(tiny_stack.url, tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    by_type: dict[str, list[dict]] = {}
    for row in rows:
        by_type.setdefault(row["Type"], []).append(row)
    assert {"POST", "TTFT", "TPOT"} <= set(by_type), rows
    for kind in ("POST", "TTFT", "TPOT"):
        assert sum(int(r["Request Count"]) for r in by_type[kind]) > 0
        assert {r["Name"] for r in by_type[kind]} <= {"talk", "code"}
    assert any(r["Name"] == "talk" and int(r["Request Count"]) > 0 for r in by_type["POST"])
    assert all(int(r["Failure Count"]) == 0 for r in rows)
    assert not (tmp_path / "run_failures.csv").read_text().strip().splitlines()[1:]
    assert (tmp_path / "run.html").stat().st_size > 0


def test_refused_requests_show_up_as_failures_with_the_message(tiny_stack: Stack, tmp_path: Path) -> None:
    done, rows = run_locust(tiny_stack.url, tmp_path, talk_tokens=(10**6, 10**6))
    assert done.returncode == 1, done.stderr[-3000:]
    failures = list(csv.DictReader((tmp_path / "run_failures.csv").open()))
    assert failures and {(f["Method"], f["Name"]) for f in failures} == {("POST", "talk")}
    assert all("HTTP 400" in f["Error"] and "maximum context length" in f["Error"] for f in failures)
    talk = {r["Type"]: r for r in rows if r["Name"] == "talk"}
    assert set(talk) == {"POST"} and talk["POST"]["Request Count"] == talk["POST"]["Failure Count"]
    code = {r["Type"]: int(r["Failure Count"]) for r in rows if r["Name"] == "code"}
    assert code == {"POST": 0, "TTFT": 0, "TPOT": 0}                 # the other prompt kind keeps working


def test_a_gateway_with_api_keys_needs_the_key(tiny_model_dir: Path, tmp_path: Path) -> None:
    from tests.integration.conftest import start_stack

    stack = start_stack(tmp_path, tiny_model_dir, extra_env={"API_KEYS": "team=sesame"})
    try:
        done, rows = run_locust(stack.url, tmp_path, "--api-key", "sesame")
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert {"POST", "TTFT", "TPOT"} <= {r["Type"] for r in rows}
        done, rows = run_locust(stack.url, tmp_path)
        failures = list(csv.DictReader((tmp_path / "run_failures.csv").open()))
        assert done.returncode == 1 and failures
        assert {(f["Method"], f["Name"]) for f in failures} == {("GET", "/v1/models")}
        assert all("HTTP 401" in f["Error"] for f in failures), failures
    finally:
        stack.stop()
