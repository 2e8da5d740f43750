"""The generated stubs in fairserve/v1/ must match what proto/ generates now."""

from __future__ import annotations

import filecmp
from pathlib import Path

from scripts.gen_protos import ROOT, generate


def _files(directory: Path) -> set[Path]:
    return {p.relative_to(directory) for p in directory.rglob("*.py*") if p.is_file()}


def test_generated_stubs_are_current(tmp_path: Path) -> None:
    generate(tmp_path)
    fresh, current = tmp_path / "fairserve" / "v1", ROOT / "fairserve" / "v1"
    assert _files(fresh) == _files(current), "stale stubs: run `make proto`"
    for relative in _files(fresh):
        assert filecmp.cmp(fresh / relative, current / relative, shallow=False), (
            f"fairserve/v1/{relative} is stale: run `make proto`")


def test_every_service_contract_is_versioned() -> None:
    protos = sorted((ROOT / "proto").rglob("*.proto"))
    assert protos, "no proto files"
    for proto in protos:
        assert "package fairserve.v1;" in proto.read_text(), proto
