"""The import rules of pyproject.toml's [tool.importlinter] hold (`lint-imports`): the layers,
the services' independence, and the pure cores (no gRPC, protobuf, FastAPI or stubs). The same
rules catch a breach in a throwaway tree, so a contract that stopped biting would show here."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from fairserve.launcher.stack import ROOT

LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _lint(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(cwd)}
    return subprocess.run([str(LINT_IMPORTS), "--no-cache", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_import_contracts_are_kept() -> None:
    result = _lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def _module(root: Path, name: str, source: str = "") -> None:
    """Writes module `name` (and its packages) under root, appending `source`."""
    parts = name.split(".")
    for depth in range(1, len(parts)):
        package = root.joinpath(*parts[:depth])
        package.mkdir(exist_ok=True)
        (package / "__init__.py").touch()
    path = root.joinpath(*parts[:-1], parts[-1] + ".py")
    path.write_text((path.read_text() if path.exists() else "") + source)


def _tree(root: Path, modules: dict[str, str]) -> None:
    """The contracts over a tree holding every module they name, the imports they let through
    (ignore_imports) and `modules`."""
    (root / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    for contract in contracts:
        named = [*contract.get("source_modules", ()), *contract.get("modules", ()),
                 *(m.strip() for layer in contract.get("layers", ()) for m in layer.split(":"))]
        for name in named:
            _module(root, name + ".__init__")
        for ignored in contract.get("ignore_imports", ()):
            importer, imported = (side.strip() for side in ignored.split("->"))
            _module(root, imported)
            _module(root, importer, f"import {imported}\n")
    for name, source in modules.items():
        _module(root, name, source)


@pytest.mark.parametrize(("contract", "modules", "said"), [
    ("pure-scheduler-core", {"services.scheduler.core.planner": "import grpc\n"}, "grpc"),
    ("pure-engine", {"services.worker.engine.sampling.sampler": "from google.protobuf import message\n"},
     "google"),
    ("services-independent", {"services.worker.settings": "from services.scheduler import limits\n",
                              "services.scheduler.limits": ""}, "services.scheduler"),
    ("layers", {"common.step": "from services.worker import settings\n",
                "services.worker.settings": ""}, "services.worker"),
])
def test_a_breach_is_caught(tmp_path: Path, contract: str, modules: dict[str, str], said: str) -> None:
    _tree(tmp_path, modules)
    result = _lint(tmp_path, "--contract", contract)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "BROKEN" in result.stdout and said in result.stdout
