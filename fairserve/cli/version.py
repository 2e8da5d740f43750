"""The installed package's version (pyproject.toml's, read from the checkout when fairserve runs
from source without being installed)."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def package_version() -> str:
    try:
        return metadata.version("fairserve")
    except metadata.PackageNotFoundError:
        match = re.search(r'^version = "([^"]+)"', PYPROJECT.read_text(encoding="utf-8"), re.M)
        return match.group(1) if match else "unknown"
