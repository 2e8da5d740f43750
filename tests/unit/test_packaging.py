"""fairserve as a package: the wheel carries the services, the generated gRPC stubs, the
dashboard and the C kernels' sources (nothing of tests or benchmarks), declares the `fairserve`
command and the same pins as requirements-runtime.txt, and runs from the wheel alone."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from fairserve.launcher.stack import ROOT


def _pins(path: Path) -> set[str]:
    lines = (line.split("#")[0].strip() for line in path.read_text().splitlines())
    return {line for line in lines if line and not line.startswith("-r")}


def test_dependencies_are_the_runtime_requirements() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert set(project["dependencies"]) == _pins(ROOT / "requirements-runtime.txt")
    assert set(project["optional-dependencies"]["test"]) == _pins(ROOT / "requirements.txt")
    assert set(project["optional-dependencies"]["bench"]) == _pins(ROOT / "requirements-bench.txt")
    assert project["scripts"] == {"fairserve": "fairserve.cli.main:main"}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    shutil.rmtree(ROOT / "build", ignore_errors=True)   # setuptools' staging: stale modules would ship
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(out), str(ROOT)], check=True, timeout=300)
    return next(out.glob("fairserve-*.whl"))


def test_the_wheel_carries_what_the_services_need(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    for needed in ("fairserve/v1/scheduler_pb2.py", "fairserve/v1/worker_pb2_grpc.py",
                   "fairserve/cli/main.py", "fairserve/launcher/run_stack.py",
                   "fairserve/dashboard/index.html", "services/gateway/main.py",
                   "services/worker/engine/cpu/native/paged_decode.c", "common/settings/schema.py"):
        assert needed in names, needed
    assert not [n for n in names if n.startswith(("tests/", "benchmarks/", "loadsim/", "scripts/"))]
    modules = [n for n in names if n.endswith(".py") and not n.startswith("fairserve/v1/")]
    assert [n for n in modules if not (ROOT / n).is_file() and not n.startswith("fairserve/dashboard/")] == []
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "fairserve = fairserve.cli.main:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_the_installed_wheel_runs_without_the_checkout(wheel: Path, tmp_path: Path) -> None:
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                    str(target), str(wheel)], check=True, timeout=300)
    probe = ("import fairserve, services.gateway.app as app, fairserve.v1.common_pb2;"
             "from fairserve.cli.main import main;"
             "print(fairserve.__file__); print(app.DASHBOARD_DIR.is_dir()); main(['version'])")
    result = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120, env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr
    where, dashboard, version = result.stdout.splitlines()
    assert where.startswith(str(target)) and dashboard == "True" and version == "fairserve 0.1.0"
