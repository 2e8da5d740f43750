"""The shared libraries' start-up pages: which mappings qualify (only a shared object's clean,
read-only ones), what is released, and that the process runs on after a real release."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch

from services.worker.engine.cpu import library_pages
from services.worker.engine.cpu.host_memory import MADV_DONTNEED

SMAPS = """\
7f0000000000-7f0000400000 r-xp 00000000 08:01 1234   /venv/lib/libtorch_cpu.so
Size:               4096 kB
Rss:                3000 kB
Anonymous:             0 kB
7f0000400000-7f0000500000 r--p 00400000 08:01 1234   /venv/lib/libtorch_cpu.so
Size:               1024 kB
Rss:                1024 kB
Anonymous:           512 kB
7f0000500000-7f0000600000 rw-p 00500000 08:01 1234   /venv/lib/libtorch_cpu.so
Size:               1024 kB
Rss:                1024 kB
Anonymous:             0 kB
7f0000600000-7f0000700000 r--p 00000000 08:01 99     /usr/lib/libc.so.6
Size:               1024 kB
Rss:                 100 kB
Anonymous:             0 kB
7f0000700000-7f0000800000 r--p 00000000 08:01 98     /models/model.safetensors
Size:               1024 kB
Rss:                1024 kB
Anonymous:             0 kB
7f0000800000-7f0000900000 rw-p 00000000 00:00 0
Size:               1024 kB
Rss:                1024 kB
Anonymous:          1024 kB
7f0000900000-7f0000a00000 r-xp 00000000 08:01 97     /venv/lib/libgomp.so.1
Size:               1024 kB
Rss:                   0 kB
Anonymous:             0 kB
7f0000a00000-7f0000b00000 r-xp 00000000 08:01 96     /data/.so/notalibrary
Size:               1024 kB
Rss:                 200 kB
Anonymous:             0 kB
"""


def test_only_clean_read_only_shared_object_mappings_qualify() -> None:
    found = library_pages.mappings(SMAPS)
    assert len(found) == 8
    assert [m.path.rsplit("/", 1)[-1] for m in found if m.clean_library] == ["libtorch_cpu.so", "libc.so.6"]
    text = found[0]
    assert (text.start, text.end, text.perms, text.resident_kb, text.anonymous_kb) == (
        0x7f0000000000, 0x7f0000400000, "r-xp", 3000, 0)


def test_a_mapping_whose_anonymous_size_is_not_read_is_left() -> None:
    found = library_pages.mappings("7f0000000000-7f0000001000 r-xp 00000000 08:01 1 /lib/libx.so\nRss: 4 kB\n")
    assert not found[0].clean_library


def test_release_unmaps_those_mappings_whole_and_counts_their_resident_bytes(tmp_path: Path) -> None:
    smaps = tmp_path / "smaps"
    smaps.write_text(SMAPS)
    calls: list[tuple[int, int, int]] = []
    released = library_pages.release_library_pages(str(smaps), lambda start, length, advice: calls.append(
        (start, length, advice)) or 0)
    assert calls == [(0x7f0000000000, 0x400000, MADV_DONTNEED), (0x7f0000600000, 0x100000, MADV_DONTNEED)]
    assert released == (3000 + 100) << 10


def test_a_refused_madvise_counts_nothing_and_no_smaps_releases_nothing(tmp_path: Path) -> None:
    smaps = tmp_path / "smaps"
    smaps.write_text(SMAPS)
    assert library_pages.release_library_pages(str(smaps), lambda start, length, advice: -1) == 0
    assert library_pages.release_library_pages(str(tmp_path / "missing"), lambda *args: 0) == 0


def _resident_file_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssFile:"):
            return int(line.split()[1])
    raise AssertionError("no RssFile")


def test_this_process_lets_its_library_pages_go_and_runs_on() -> None:
    if not Path("/proc/self/smaps").is_file():
        pytest.skip("no /proc")
    try:
        ctypes.CDLL("libc.so.6").madvise
    except (OSError, AttributeError):
        pytest.skip("not glibc")
    x = torch.randn(64, 64)
    expected = (x @ x).sum().item()
    before = _resident_file_kb()
    released = library_pages.release_library_pages()
    assert released > 0
    assert _resident_file_kb() < before
    assert (x @ x).sum().item() == expected      # the code pages come back as they run
