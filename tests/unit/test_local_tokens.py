"""`make run`'s generated tokens (fairserve/launcher/local_tokens.py): made once in a
private file and reused; a token the user gives wins; a file others could read
is refused. And the launcher passes them, the worker token to the scheduler
and workers only."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from common.transport.internal_auth import InternalAuth
from common.settings.env import SettingsError
from fairserve.launcher.local_tokens import local_tokens, tokens_path
from fairserve.launcher.stack import Stack, StackPorts

USER_TOKEN = "user-given-internal-token-0123"


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_tokens_are_made_once_privately_then_reused(tmp_path: Path) -> None:
    path = tmp_path / "cache" / "tokens" / "local.json"
    first = local_tokens({}, path)
    assert set(first) == {"INTERNAL_TOKEN", "WORKER_TOKEN"}
    assert first["INTERNAL_TOKEN"] != first["WORKER_TOKEN"] and all(len(v) == 64 for v in first.values())
    assert _mode(path) == 0o600 and _mode(path.parent) == 0o700
    assert local_tokens({}, path) == first
    assert json.loads(path.read_text()) == first


def test_a_token_the_user_gives_wins(tmp_path: Path) -> None:
    path = tmp_path / "tokens" / "local.json"
    generated = local_tokens({"INTERNAL_TOKEN": USER_TOKEN}, path)
    assert list(generated) == ["WORKER_TOKEN"]
    assert local_tokens({"INTERNAL_TOKEN_FILE": "/x", "WORKER_TOKEN": "y"}, tmp_path / "untouched.json") == {}
    assert not (tmp_path / "untouched.json").exists()


def test_a_file_others_can_read_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "tokens" / "local.json"
    local_tokens({}, path)
    path.chmod(0o644)
    with pytest.raises(SettingsError, match="local.json is not private.*0644.*delete it"):
        local_tokens({}, path)
    path.chmod(0o600)
    path.parent.chmod(0o755)
    with pytest.raises(SettingsError, match="tokens is not private"):
        local_tokens({}, path)
    path.parent.chmod(0o700)
    path.write_text("not json")
    with pytest.raises(SettingsError, match="local.json is invalid"):
        local_tokens({}, path)


def test_the_default_file_is_under_the_users_cache(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    assert tokens_path({}) == tmp_path / ".cache" / "fairserve" / "tokens" / "local.json"
    assert tokens_path({"LOCAL_TOKENS_FILE": "~/elsewhere.json"}) == tmp_path / "elsewhere.json"


def test_the_worker_token_reaches_the_scheduler_and_workers_only(monkeypatch, tmp_path: Path) -> None:
    seen: dict[str, dict[str, str]] = {}

    class Recorder:
        def __init__(self, command: list[str], env: dict[str, str], **_: object) -> None:
            seen[command[-1]] = env

    monkeypatch.setattr("fairserve.launcher.stack.subprocess.Popen", Recorder)
    tokens = local_tokens({}, tmp_path / "tokens" / "local.json")
    stack = Stack(ports=StackPorts(), env=tokens, log_dir=tmp_path)
    for name, module in [("kvcache", "services.kvcache.main"), ("scheduler", "services.scheduler.main"),
                         ("worker-0", "services.worker.main"), ("gateway", "services.gateway.main")]:
        stack._spawn(name, module)
    for module, env in seen.items():
        assert env["INTERNAL_TOKEN"] == tokens["INTERNAL_TOKEN"], module
        holds = module in ("services.scheduler.main", "services.worker.main")
        assert (env.get("WORKER_TOKEN") == tokens["WORKER_TOKEN"]) is holds, module
    assert stack.internal_auth() == InternalAuth(token=tokens["INTERNAL_TOKEN"].encode())
    assert stack.worker_token() == tokens["WORKER_TOKEN"].encode()


def test_the_launcher_generates_its_tokens(monkeypatch, capsys, tmp_path: Path) -> None:
    from fairserve.launcher import run_stack

    for name in ("INTERNAL_TOKEN", "INTERNAL_TOKEN_FILE", "WORKER_TOKEN", "WORKER_TOKEN_FILE", "LOCAL_TOKENS_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("LOG_DIR", str(tmp_path / "logs"))
    monkeypatch.setattr(run_stack.signal, "signal", lambda *_: None)    # pytest keeps its handlers
    monkeypatch.setattr(run_stack, "serve_metrics", lambda *_, **__: 0)
    started: list[Stack] = []

    def start(stack: Stack, timeout_s: float) -> None:
        started.append(stack)
        raise KeyboardInterrupt
    monkeypatch.setattr(Stack, "start", start)
    monkeypatch.setattr(Stack, "stop", lambda *_: None)
    assert run_stack.main() == 0
    (stack,) = started
    path = tmp_path / ".cache" / "fairserve" / "tokens" / "local.json"
    assert stack.env == json.loads(path.read_text())
    out = capsys.readouterr().out
    assert "InternalAuth(token=set" in out and str(path) in out
    assert stack.env["INTERNAL_TOKEN"] not in out and stack.env["WORKER_TOKEN"] not in out
