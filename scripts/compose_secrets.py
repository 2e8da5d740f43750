"""The files deploy/compose.yaml mounts from deploy/secrets/, made once and
checked before compose runs: `make secrets` creates the missing ones (random
tokens, an empty gateway.env: an open API until you add API_KEYS) and never
touches one that exists; `make compose-up` checks them first, so a missing
file is one line naming it and the command that makes it, not a compose
traceback. Standard library only: it runs before any venv exists.

    python3 scripts/compose_secrets.py make  [--dir deploy/secrets]
    python3 scripts/compose_secrets.py check [--dir deploy/secrets]

Modes: compose bind-mounts a secret file as it is, and the services read it as
uid 10001 (Redis as 999), so the mounted files are 0644 in a directory only
you can enter (0700); gateway.env (API keys) is read by compose on the host
only, so it is 0600.
"""

from __future__ import annotations

import argparse
import os
import secrets
import stat
import sys
from pathlib import Path

DEFAULT_DIR = Path(__file__).resolve().parents[1] / "deploy" / "secrets"
# Every `secrets:` file of deploy/compose.yaml (TLS ones are commented out there), and its env file.
MOUNTED = ("internal_token", "worker_token", "redis_password")
ENV_FILES = ("gateway.env",)
DIR_MODE, MOUNTED_MODE, ENV_MODE = 0o700, 0o644, 0o600


class SecretsError(Exception):
    """A one-line message: what is wrong, with which file, and what to run."""


def shown(path: Path) -> str:
    """The path as the user would type it: relative to the working directory when under it."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def make_hint(directory: Path) -> str:
    if directory == DEFAULT_DIR:
        return "run `make secrets` (or python3 scripts/compose_secrets.py make)"
    return f"run python3 scripts/compose_secrets.py make --dir {shown(directory)}"


def make(directory: Path) -> list[Path]:
    """Creates the missing files (an existing one, however it looks, is left
    as it is) and returns the ones it created; then checks them all."""
    directory.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    directory.chmod(DIR_MODE)
    created = []
    for name in MOUNTED + ENV_FILES:
        content = "" if name in ENV_FILES else secrets.token_hex(32) + "\n"
        mode = ENV_MODE if name in ENV_FILES else MOUNTED_MODE
        if _create(directory / name, content, mode):
            created.append(directory / name)
    check(directory)
    return created


def _create(path: Path, content: str, mode: int) -> bool:
    """Writes a new file (O_EXCL: an existing one is never replaced, even by a
    race), its mode set exactly whatever the umask; False when it exists."""
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return False
    with os.fdopen(descriptor, "w") as file:
        os.fchmod(file.fileno(), mode)
        file.write(content)
    return True


def check(directory: Path) -> None:
    """Raises SecretsError for the first file compose would fail on."""
    missing = [shown(directory / name) for name in MOUNTED + ENV_FILES if not (directory / name).is_file()]
    if missing:
        raise SecretsError(f"missing {', '.join(missing)}: {make_hint(directory)}")
    for name in MOUNTED:
        path = directory / name
        if not path.read_text(errors="replace").strip():
            raise SecretsError(f"{shown(path)} is empty: delete it and {make_hint(directory)}")
        if not path.stat().st_mode & stat.S_IROTH:
            raise SecretsError(f"{shown(path)} is mode {stat.S_IMODE(path.stat().st_mode):o}, unreadable by "
                               f"the containers' users: chmod 644 {shown(path)} (and 700 {shown(directory)})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["make", "check"])
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="where compose.yaml's secrets live")
    args = parser.parse_args(argv)
    directory = args.dir.resolve()
    try:
        if args.action == "make":
            created = make(directory)
            print(f"created {', '.join(shown(path) for path in created)}" if created
                  else f"{shown(directory)}: every secret exists, none changed")
        else:
            check(directory)
    except SecretsError as error:
        print(f"compose secrets: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
