"""Puts the repository root and the generated stubs on the venv's import path."""

from __future__ import annotations

import site
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

if __name__ == "__main__":
    target = Path(site.getsitepackages()[0]) / "fairserve-paths.pth"
    target.write_text(f"{ROOT}\n{ROOT / 'gen'}\n")
