"""Small HTTP/SSE helpers for driving the gateway in integration tests."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from fairserve.launcher.stack import ROOT


def sse_events(response: httpx.Response) -> list[dict[str, Any]]:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line[len("data: "):]))
    return events


def stream_generate(base_url: str, body: dict[str, Any], timeout: float = 120) -> list[dict[str, Any]]:
    with httpx.stream("POST", f"{base_url}/generate", json={**body, "stream": True},
                      timeout=timeout) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        return sse_events(response)


def start_launcher(env: dict[str, str], timeout_s: float = 180, cwd: Path = ROOT,
                   args: tuple[str, ...] = ()) -> tuple[subprocess.Popen[str], str]:
    """`make run`'s launcher (`fairserve run`, the installed command, or its module where the
    package is not installed) with `env` and `args`, and its banner once it has printed it
    (every service started); the caller stops the launcher."""
    script = Path(sys.executable).parent / "fairserve"
    command = [str(script), "run"] if script.exists() else [sys.executable, "-m", "fairserve.cli.main", "run"]
    launcher = subprocess.Popen([*command, *args], cwd=cwd, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    banner = ""
    deadline = time.monotonic() + timeout_s
    try:
        while "Ctrl-C stops" not in banner and time.monotonic() < deadline:
            line = launcher.stdout.readline()
            assert line or launcher.poll() is None, f"launcher exited:\n{banner}"
            banner += line
    except BaseException:
        launcher.kill()
        raise
    return launcher, banner
