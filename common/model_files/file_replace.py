"""A file's text replaced whole: written beside it, given its mode, then renamed over it, so
that a reader (another service starting side by side) sees the old file or the new one, never
half of one."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path


def replace_text(path: Path, text: str) -> None:
    """Replaces the existing file at `path` with `text` (UTF-8), keeping its mode."""
    handle, scratch = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}-", suffix=path.suffix)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.write(text)
        os.chmod(scratch, stat.S_IMODE(path.stat().st_mode))
        os.replace(scratch, path)
    except BaseException:
        Path(scratch).unlink(missing_ok=True)
        raise
