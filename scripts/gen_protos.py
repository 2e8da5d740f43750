"""Generates the Python gRPC stubs from proto/ into the given directory (default: the checkout,
as fairserve/v1/; setup.py runs it when the package is built)."""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc
import grpc_tools

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"
sys.path.insert(0, str(ROOT))     # setup.py runs this file with only scripts/ on the path
from fairserve.launcher.stub_sources import write_digest  # noqa: E402


def proto_files() -> list[Path]:
    return sorted(PROTO_ROOT.rglob("*.proto"))


def generate(out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    include = Path(grpc_tools.__file__).parent / "_proto"
    args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={out_dir}",
            f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}"]
    args += [str(p.relative_to(PROTO_ROOT)) for p in proto_files()]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    for package_dir in {p.parent.relative_to(PROTO_ROOT) for p in proto_files()}:
        parts = package_dir.parts
        for depth in range(1, len(parts) + 1):
            (out_dir.joinpath(*parts[:depth]) / "__init__.py").touch()
    write_digest(out_dir / "fairserve" / "v1", PROTO_ROOT)


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
