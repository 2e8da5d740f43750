"""Compiles the engine's small C kernels (`native/*.c`) once per machine and loads them.

A library is built with the system C compiler (`cc -O3 -march=native -fopenmp`) into a
cache directory, under a key of its source, the flags, the compiler's version and the CPU,
so a changed kernel or another CPU builds afresh. It is compiled to a temporary name and
renamed, so that workers starting together never load a half-written file. OpenMP comes
from the `libgomp` torch already loaded (same soname), so torch and the kernels share one
thread pool.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

log = logging.getLogger(__name__)
Binding = TypeVar("Binding")

SOURCES = Path(__file__).resolve().parents[1] / "native"   # cpu/native/: the C sources
# Libraries built from more than their own `native/<name>.c`: the further sources, linked in.
EXTRA_SOURCES = {"int8_matmul": ("codes_screen.c", "codes_screen_plane.c", "codes_screen_quads.c", "screen_pick.c")}
COMPILE_FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11")
COMPILE_TIMEOUT_S = 120


class NativeBuildError(RuntimeError):
    """No C compiler, or it failed, or the library does not load."""


def default_cache_dir() -> Path:
    return Path(os.path.expanduser("~/.cache/fairserve/kernels"))


@functools.lru_cache(maxsize=None)
def load_library(name: str, cache_dir: Path) -> ctypes.CDLL:
    """`native/<name>.c` built (if needed) and loaded; once per process and cache dir."""
    try:
        return ctypes.CDLL(str(build(name, cache_dir)))
    except OSError as error:
        raise NativeBuildError(f"cannot load the {name} kernel: {error}") from error


def load_binding(binding: Callable[[ctypes.CDLL], Binding], name: str, cache_dir: Path,
                 fallback: str) -> Binding | None:
    """`binding` over the library of `native/<name>.c`, or None (no compiler, or it failed),
    logging what serves instead (`fallback`)."""
    try:
        return binding(load_library(name, cache_dir))
    except NativeBuildError as error:
        log.warning("native %s kernel unavailable; %s", name, fallback, extra={"reason": str(error)})
        return None


def build(name: str, cache_dir: Path) -> Path:
    """The compiled library of `native/<name>.c` (with its EXTRA_SOURCES) for these sources,
    flags, compiler and CPU."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise NativeBuildError("no C compiler (cc) on PATH")
    source_paths = [SOURCES / f"{name}.c", *(SOURCES / extra for extra in EXTRA_SOURCES.get(name, ()))]
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                                 timeout=COMPILE_TIMEOUT_S).stdout
    except (OSError, subprocess.SubprocessError) as error:
        raise NativeBuildError(f"{compiler} does not run: {error}") from error
    headers = [header.read_bytes() for header in sorted(SOURCES.glob("*.h"))]
    sources = [path.read_bytes() for path in source_paths]
    key = hashlib.sha256(b"\0".join([*sources, *headers, " ".join(COMPILE_FLAGS).encode(), version.encode(),
                                      platform.machine().encode(), _cpu_flags().encode()])).hexdigest()[:20]
    target = cache_dir / f"{name}-{key}.so"
    if target.is_file():
        return target
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        handle, partial = tempfile.mkstemp(prefix=target.name, suffix=".tmp", dir=cache_dir)
    except OSError as error:
        raise NativeBuildError(f"cannot write to {cache_dir}: {error}") from error
    os.close(handle)
    try:
        result = subprocess.run([compiler, *COMPILE_FLAGS, "-o", partial, *map(str, source_paths), "-lm"],
                                capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
        if result.returncode != 0:
            raise NativeBuildError(f"{compiler} failed: {result.stderr.strip()[-2000:]}")
        os.replace(partial, target)
    except (OSError, subprocess.SubprocessError) as error:
        raise NativeBuildError(f"{compiler} failed: {error}") from error
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith(("flags", "Features", "model name")):
                    return line
    except OSError:
        pass
    return platform.processor()
