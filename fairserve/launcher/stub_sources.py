"""Whether the gRPC stubs in a source checkout were generated from its proto/ as it is now.

The stubs (fairserve/v1/, generated, not committed) are rebuilt by `make` when a .proto file
changes, but a checkout updated with `git pull` and started with `fairserve run` or a
benchmark straight away keeps the old ones: every service then starts, and the first step
fails on a field the old stubs lack (a 500 for every request, "the request was running on 3
workers that failed"). So the generator writes a digest of the sources beside the stubs
(`write_digest`) and the launcher refuses to start a checkout whose stubs do not match
(`stale_stubs`). An installed package has no proto/ beside it and is not checked: its stubs
were generated when it was built.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

DIGEST_FILE = "PROTO_SHA256"      # in fairserve/v1/, beside the stubs


def proto_digest(proto_root: Path) -> str:
    """sha256 over every .proto file under `proto_root`: relative path and content, in path order."""
    digest = hashlib.sha256()
    for path in sorted(proto_root.rglob("*.proto")):
        digest.update(path.relative_to(proto_root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def write_digest(stubs_dir: Path, proto_root: Path) -> None:
    """Records which sources the stubs in `stubs_dir` were generated from."""
    (stubs_dir / DIGEST_FILE).write_text(proto_digest(proto_root) + "\n")


def stale_stubs(root: Path) -> str | None:
    """Why the stubs of the checkout at `root` are not those of its proto/, or None when they
    are (or when `root` holds no proto/: an installed package)."""
    proto_root, stubs_dir = root / "proto", root / "fairserve" / "v1"
    if not proto_root.is_dir():
        return None
    recorded = stubs_dir / DIGEST_FILE
    if not recorded.is_file():
        return f"{stubs_dir} holds no stubs generated from {proto_root}: run `make proto`"
    if recorded.read_text().strip() != proto_digest(proto_root):
        return f"the gRPC stubs in {stubs_dir} are older than {proto_root}: run `make proto`"
    return None
