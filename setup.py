"""Builds the fairserve package: the gRPC stubs are generated from proto/ into fairserve/v1
first (grpcio-tools is a build requirement), so an installed fairserve carries them."""

from __future__ import annotations

import sys
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "scripts"))
from gen_protos import generate  # noqa: E402  (scripts/ is not part of the package)

generate(ROOT)

setup(
    packages=find_packages(include=["fairserve", "fairserve.*", "common", "common.*",
                                    "services", "services.*"])
    + ["fairserve.dashboard", "services.worker.engine.cpu.native"],
    package_dir={"fairserve.dashboard": "dashboard"},
    package_data={"services.worker.engine.cpu.native": ["*.c", "*.h"],
                  "fairserve.dashboard": ["*.html", "*.js", "*.css"]},
)
