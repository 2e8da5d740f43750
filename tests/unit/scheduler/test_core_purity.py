"""The scheduling core stays pure: no module in it imports gRPC or protobuf."""

from __future__ import annotations

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parents[3] / "services" / "scheduler" / "core"
FORBIDDEN = ("grpc", "google.protobuf", "fairserve.v1")


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_no_core_module_imports_grpc_or_protobuf() -> None:
    modules = sorted(CORE.glob("*.py"))
    assert len(modules) > 5
    for path in modules:
        bad = [name for name in _imports(path) if name.startswith(FORBIDDEN)]
        assert not bad, f"{path.name} imports {bad}"
