"""`make run`'s own internal tokens, so a laptop's internal ports are closed by
default: INTERNAL_TOKEN and WORKER_TOKEN (common/transport/worker_auth.py), random,
kept in ~/.cache/fairserve/tokens/local.json (LOCAL_TOKENS_FILE names another;
its folder 0700, the file 0600, both checked on every start) and reused on
later runs. A token the user gives (the variable or its _FILE form) wins over
the generated one."""

from __future__ import annotations

import json
import os
import secrets
import stat
from collections.abc import Mapping
from pathlib import Path

from common.settings.env import SettingsError

TOKEN_NAMES = ("INTERNAL_TOKEN", "WORKER_TOKEN")


def tokens_path(env: Mapping[str, str]) -> Path:
    return Path(env.get("LOCAL_TOKENS_FILE") or "~/.cache/fairserve/tokens/local.json").expanduser()


def local_tokens(env: Mapping[str, str], path: Path) -> dict[str, str]:
    """The generated tokens for the variables `env` leaves unset (none: the file
    is not touched); made once, then read from `path`."""
    missing = [name for name in TOKEN_NAMES if not env.get(name) and not env.get(f"{name}_FILE")]
    if not missing:
        return {}
    tokens = _read(path) if path.exists() else {}
    if any(name not in tokens for name in TOKEN_NAMES):
        tokens = {name: tokens.get(name) or secrets.token_hex(32) for name in TOKEN_NAMES}
        _write(path, tokens)
    return {name: tokens[name] for name in missing}


def _read(path: Path) -> dict[str, str]:
    _check_private(path.parent, 0o077)
    _check_private(path, 0o077)
    try:
        tokens = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise SettingsError(f"{path} is invalid: cannot read its tokens ({error.__class__.__name__}); "
                            "delete it and a new pair is made") from None
    if not isinstance(tokens, dict) or not all(isinstance(tokens.get(name, ""), str) for name in TOKEN_NAMES):
        raise SettingsError(f"{path} is invalid: expected {{\"INTERNAL_TOKEN\": ..., \"WORKER_TOKEN\": ...}}; "
                            "delete it and a new pair is made")
    return {name: tokens[name] for name in TOKEN_NAMES if tokens.get(name)}


def _write(path: Path, tokens: dict[str, str]) -> None:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    _check_private(path.parent, 0o077)
    partial = path.with_name(path.name + ".new")
    partial.unlink(missing_ok=True)
    descriptor = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as file:
        json.dump(tokens, file)
    partial.replace(path)


def _check_private(path: Path, forbidden: int) -> None:
    """Owned by this user and closed to everyone else, or a SettingsError naming it."""
    info = path.stat()
    if info.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) & forbidden:
        raise SettingsError(f"{path} is not private: it must belong to you with mode 0700 (folder) "
                            f"or 0600 (file), and has {stat.S_IMODE(info.st_mode):04o}; the tokens in it "
                            "may have been read: delete it and a new pair is made")
