"""Let the shared libraries' start-up pages go (CPU host memory).

Importing torch and building the engine read ~100 MB of the shared libraries' code and
read-only data (libtorch_cpu.so alone ~70 MB: its static initializers register thousands of
operators from all over the library), and every page read stays in the process's resident set
although a step runs a small part of that code again. Those pages are the files' own (clean):
`release_library_pages` unmaps them from this process (madvise MADV_DONTNEED), and a page
that runs again comes back from the page cache on its first touch (a minor fault, no disk
read while the file stays cached). On the default model, after the engine's preparation:
~100 MB less resident, ~35 MB of it back after a few steps.

Only pages that cannot hold anything of the process's own are touched: mappings of shared
objects (a path with `.so`) that are not writable and hold no anonymous page (a private
mapping's page that was ever written, e.g. relocated read-only data, is anonymous: its
mapping is left whole). Nothing here runs per step: at the quiet points where the heap's
freed pages go back too (after preparation, after the LM head screen's and the grammar
tokenizer's builds, when the worker is idle).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from services.worker.engine.cpu.host_memory import MADV_DONTNEED, glibc_madvise

_HEADER = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S{4}) \S+ \S+ \d+\s*(.*)$")


@dataclass
class Mapping:
    start: int
    end: int
    perms: str            # e.g. r-xp
    path: str             # "" for an anonymous mapping
    resident_kb: int = 0
    anonymous_kb: int = -1    # -1 until read (then treated as holding anonymous pages)

    @property
    def clean_library(self) -> bool:
        """A shared object's mapping whose resident pages are all the file's own."""
        return (".so" in Path(self.path).name and "w" not in self.perms and self.anonymous_kb == 0
                and self.resident_kb > 0)


def mappings(smaps: str) -> list[Mapping]:
    """The mappings of a /proc/PID/smaps text, with their resident and anonymous sizes."""
    found: list[Mapping] = []
    for line in smaps.splitlines():
        header = _HEADER.match(line)
        if header is not None:
            found.append(Mapping(int(header.group(1), 16), int(header.group(2), 16), header.group(3),
                                 header.group(4).strip()))
        elif found and line.startswith(("Rss:", "Anonymous:")):
            name, value = line.split()[:2]
            if name == "Rss:":
                found[-1].resident_kb = int(value)
            else:
                found[-1].anonymous_kb = int(value)
    return found


def release_library_pages(smaps: str = "/proc/self/smaps",
                          madvise: Callable[[int, int, int], int] | None = None) -> int:
    """Unmaps the resident pages of this process's clean shared-object mappings (the module
    docstring); returns the bytes they held (0 where /proc or glibc is not there)."""
    try:
        text = Path(smaps).read_text()
    except OSError:
        return 0
    madvise = madvise or glibc_madvise()
    if madvise is None:
        return 0
    released = 0
    for mapping in mappings(text):
        if mapping.clean_library and madvise(mapping.start, mapping.end - mapping.start, MADV_DONTNEED) == 0:
            released += mapping.resident_kb << 10
    return released
