"""A worker process is prepared before torch loads: OpenMP's spin bound (unless the environment
sets one) and one malloc arena; `fairserve worker` prepares it as `python -m services.worker.main`
does, and a command without a preparation starts as it did."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from fairserve.cli import schemas
from services.worker.host import process_start


def test_the_spin_bound_is_set_unless_the_environment_has_one(monkeypatch: pytest.MonkeyPatch) -> None:
    arenas: list[int] = []
    monkeypatch.setattr(process_start, "share_one_malloc_arena", lambda: arenas.append(1) or True)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    process_start.prepare_process()
    assert os.environ["GOMP_SPINCOUNT"] == process_start.GOMP_SPINCOUNT
    monkeypatch.setenv("GOMP_SPINCOUNT", "5")
    process_start.prepare_process()
    assert os.environ["GOMP_SPINCOUNT"] == "5" and arenas == [1, 1]


def test_preparing_loads_no_torch() -> None:
    code = ("import sys; from services.worker.host.process_start import prepare_process; prepare_process(); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_fairserve_worker_prepares_its_process_first(monkeypatch: pytest.MonkeyPatch) -> None:
    prepared: list[str] = []
    monkeypatch.setattr(process_start, "prepare_process", lambda: prepared.append("worker"))
    main = schemas.entry_point("worker")
    assert prepared == ["worker"] and main.__module__ == "services.worker.main"
    schemas.entry_point("kvcache")
    assert prepared == ["worker"]
