"""fairserve's version, from one place: the installed package's metadata, or the checkout's
pyproject.toml ([project] version) when the package is not installed."""

from __future__ import annotations

import tomllib
from importlib import metadata
from pathlib import Path

PACKAGE = "fairserve"
PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
UNKNOWN = "0+unknown"


def package_version(pyproject: Path = PYPROJECT) -> str:
    """The installed fairserve's version, else `pyproject`'s, else UNKNOWN."""
    try:
        return metadata.version(PACKAGE)
    except metadata.PackageNotFoundError:
        pass
    try:
        return str(tomllib.loads(pyproject.read_text())["project"]["version"])
    except (OSError, KeyError, TypeError, tomllib.TOMLDecodeError):
        return UNKNOWN
