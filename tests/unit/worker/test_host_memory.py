"""The allocator tuning applies once on glibc and is a no-op elsewhere."""

from __future__ import annotations

import ctypes

import pytest

from services.worker.engine.cpu import host_memory


def test_tuning_applies_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(host_memory, "_applied", None)
    monkeypatch.setattr(host_memory, "_tune_glibc", lambda: calls.append(1) or True)
    assert host_memory.keep_freed_host_memory() and host_memory.keep_freed_host_memory()
    assert calls == [1]


def test_glibc_accepts_the_settings() -> None:
    try:
        ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        pytest.skip("not glibc")
    assert host_memory._tune_glibc()


def test_without_glibc_nothing_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_libc(name: str) -> object:
        raise OSError("no such library")

    monkeypatch.setattr(host_memory.ctypes, "CDLL", no_libc)
    assert host_memory._tune_glibc() is False
    assert host_memory.release_freed_host_memory() is False


def test_freed_memory_goes_back() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        pytest.skip("not glibc")
    assert host_memory.release_freed_host_memory()
