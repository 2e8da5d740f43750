"""`make secrets` (scripts/compose_secrets.py): the files deploy/compose.yaml
mounts are created once with their modes, an existing one is never changed,
and a missing or unusable one is a one-line error naming it and the command to
run, before compose runs (`make compose-up` checks first)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from scripts import compose_secrets
from scripts.compose_secrets import SecretsError, check, make

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "compose_secrets.py"
ALL = compose_secrets.MOUNTED + compose_secrets.ENV_FILES


@pytest.fixture(params=[0o022, 0o077, 0o000], ids=["umask022", "umask077", "umask000"])
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    previous = os.umask(request.param)
    yield request.param
    os.umask(previous)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_make_creates_every_file_with_its_mode(tmp_path: Path, umask: int) -> None:
    directory = tmp_path / "secrets"
    created = make(directory)
    assert [path.name for path in created] == list(ALL)
    assert mode(directory) == 0o700
    tokens = set()
    for name in compose_secrets.MOUNTED:
        text = (directory / name).read_text()
        assert len(text.strip()) == 64 and int(text, 16) and mode(directory / name) == 0o644, name
        tokens.add(text)
    assert len(tokens) == len(compose_secrets.MOUNTED)       # one token per secret, never shared
    assert (directory / "gateway.env").read_text() == "" and mode(directory / "gateway.env") == 0o600


def test_make_again_changes_nothing(tmp_path: Path) -> None:
    make(tmp_path)
    before = {name: ((tmp_path / name).read_bytes(), (tmp_path / name).stat().st_mtime_ns) for name in ALL}
    assert make(tmp_path) == []
    assert {name: ((tmp_path / name).read_bytes(), (tmp_path / name).stat().st_mtime_ns) for name in ALL} == before


def test_make_never_overwrites_an_existing_secret(tmp_path: Path) -> None:
    (tmp_path / "gateway.env").write_text("API_KEYS=alice=sk-mine\n")
    (tmp_path / "gateway.env").chmod(0o640)
    (tmp_path / "internal_token").write_text("my-own-token\n")
    (tmp_path / "internal_token").chmod(0o644)
    created = make(tmp_path)
    assert sorted(path.name for path in created) == ["redis_password", "worker_token"]
    assert (tmp_path / "gateway.env").read_text() == "API_KEYS=alice=sk-mine\n"
    assert mode(tmp_path / "gateway.env") == 0o640                # its mode is the user's too
    assert (tmp_path / "internal_token").read_text() == "my-own-token\n"


def test_check_names_each_missing_file_and_the_command(tmp_path: Path) -> None:
    make(tmp_path)
    (tmp_path / "worker_token").unlink()
    (tmp_path / "gateway.env").unlink()
    with pytest.raises(SecretsError) as raised:
        check(tmp_path)
    message = str(raised.value)
    assert "\n" not in message
    assert str(tmp_path / "worker_token") in message and str(tmp_path / "gateway.env") in message
    assert "internal_token" not in message
    assert f"compose_secrets.py make --dir {tmp_path}" in message


def test_the_default_directory_points_at_make_secrets() -> None:
    assert compose_secrets.DEFAULT_DIR == ROOT / "deploy" / "secrets"
    assert "`make secrets`" in compose_secrets.make_hint(compose_secrets.DEFAULT_DIR)


@pytest.mark.parametrize("spoil, words", [
    (lambda path: path.write_text(""), "is empty: delete it"),
    (lambda path: path.chmod(0o600), "is mode 600, unreadable by the containers' users: chmod 644"),
])
def test_check_refuses_a_token_compose_would_fail_on(tmp_path: Path, spoil, words: str) -> None:
    make(tmp_path)
    spoil(tmp_path / "redis_password")
    with pytest.raises(SecretsError, match=words) as raised:
        check(tmp_path)
    assert "redis_password" in str(raised.value)
    with pytest.raises(SecretsError):
        make(tmp_path)                                           # make leaves it, and says so
    assert mode(tmp_path / "redis_password") in (0o600, 0o644)


def test_the_command_line_error_is_one_line_and_no_traceback(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(SCRIPT), "check", "--dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert done.stderr.startswith("compose secrets: missing internal_token, worker_token, redis_password, "
                                  "gateway.env: run python3 scripts/compose_secrets.py make --dir ")
    made = subprocess.run([sys.executable, str(SCRIPT), "make", "--dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert made.returncode == 0 and made.stdout.startswith("created internal_token, "), made
    again = subprocess.run([sys.executable, str(SCRIPT), "check", "--dir", str(tmp_path)],
                           capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and again.stderr == ""


def test_the_files_are_the_ones_compose_yaml_mounts() -> None:
    compose = yaml.safe_load((ROOT / "deploy" / "compose.yaml").read_text())
    mounted = {Path(entry["file"]) for entry in compose["secrets"].values()}
    env_files = {Path(name) for spec in compose["services"].values() for name in spec.get("env_file", [])}
    assert mounted == {Path("secrets") / name for name in compose_secrets.MOUNTED}
    assert env_files == {Path("secrets") / name for name in compose_secrets.ENV_FILES}


def test_compose_up_makes_and_checks_the_secrets_before_compose_runs(tmp_path: Path) -> None:
    done = subprocess.run(["make", "-n", "compose-up", "COMPOSE=podman-compose", "PYTHON=python3"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    make_at = lines.index("python3 scripts/compose_secrets.py make")
    check_at = lines.index("python3 scripts/compose_secrets.py check")
    compose_at = next(i for i, line in enumerate(lines) if line.startswith("podman-compose "))
    assert make_at < check_at < compose_at
    assert "-f deploy/compose.yaml up -d" in lines[compose_at]
