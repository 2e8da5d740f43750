"""Keep the host allocator from handing big buffers back to the kernel.

glibc serves allocations above its mmap threshold (128 KiB, rising only as such
blocks are freed) with fresh mmap'd pages, and trims freed memory at the top of
the heap. A CPU step allocates the same multi-megabyte buffers every time
(gathered context K/V, the logits, MLP activations), so each one page-faults
all its pages back in: on a 2-core AMD EPYC that made the K/V gathers of a
decode step of 8 sequences cost ~45 ms instead of ~5. Raising the threshold to
its maximum (32 MiB) and not trimming keeps those pages mapped and reused.

The flip side: everything freed while the model is prepared (load buffers, the
LM head screen's quantization temporaries, packs that were replaced) would stay
resident too. So:

- the engine tunes the allocator only once the model is prepared (model.py): loading runs
  under glibc's defaults, its multi-megabyte temporaries are mapped and unmapped on their own
  and leave no holes in the heap. Tuned before loading, the heap kept ~480 MB of free
  (released, not resident) space among the weights of the default model, and glibc's best fit
  placed a wide step's buffers in ever other parts of it: an 822-row prefill step touched 60-80
  MB more than the process held before it, ~40 MB with the heap compact;
- `release_freed_host_memory` hands the free pages back once after preparation, and again after
  wide steps (prefill chunks of HOST_MEMORY_RELEASE_ROWS rows or more: at the end of a burst of
  them, or once the worker has nothing running; step/wide_release.py): keeping
  those kept a served 64-block worker ~25-30 MB higher under eight W1 streams; faulting them in
  again cost ~2-3 % of c32 throughput (docs/benchmarks.md). Decode steps keep theirs.

Threads that allocate while another does (the screen's and the grammar tokenizer's background
builds beside the main thread's preparation) each get an arena of their own, and what they free
there stays resident through `release_freed_host_memory`: on the 2-core AMD EPYC a worker with
prefill packs, the int8 screen copy and the grammar tokenizer built at start held 2,391 MB
instead of 1,530-1,587 with at most one or two arenas, and how much depended on how the builds
overlapped. So the engine keeps to ARENA_MAX arenas: one, since a worker whose engine built
and stepped on a thread of its own (the worker's engine thread) in a second arena held 24 MB
more: malloc_trim gives back the free pages inside every arena but the top of the main
arena's heap only. A thread takes its arena at its first allocation, so a worker process caps
them first thing (`share_one_malloc_arena`, services/worker/host/process_start.py); the engine's
tuning caps them again for a process that did not (a test, a benchmark).

Loading reads the checkpoint through a mapping of its safetensors files, and the model copies
each weight out of it (model.py, `_own_weights`): every page read stays resident in the mapping
until the load ends, so for a moment the process held the checkpoint twice (2.4 GB for the
default model's 1.07 GB). `release_file_pages` lets the mapped pages of each weight go once it is
copied (only pages wholly inside that weight's bytes and inside a mapping of a safetensors file;
read again, they come back from the file; anonymous memory is never touched). On CPU the weight
matrices are not copied at all until the speed-ups have read them (mostly into weight codes):
`CheckpointPages` lets each one's pages go as it is read, and only what the model still holds
afterwards is copied out (a starting worker at 64 blocks: 1.9 -> 0.7 GB at most).

The GEMM libraries keep memory per shape: oneDNN's primitive cache and torch's (ideep's) LRU
cache of GEMM computations each hold up to 1024 entries by default, and every prefill step of
a new row count adds one per weight shape (~6 MB a row count on Gemma 3 270M's five). A
server sees hundreds of row counts, so the worker grew without a visible bound;
`bound_gemm_caches` caps both (their environment variables, read when the first GEMM runs).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
ARENA_MAX = 1
MMAP_THRESHOLD = 32 << 20     # glibc's largest accepted value on 64-bit
TRIM_THRESHOLD = 1 << 30
TOP_PAD = 64 << 20

_applied: bool | None = None


def keep_freed_host_memory() -> bool:
    """Tunes glibc malloc for the engine's repeated large buffers, once per process.
    False where the C library is not glibc (nothing changes)."""
    global _applied
    if _applied is None:
        _applied = _tune_glibc()
    return _applied


GEMM_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound_gemm_caches(entries: int) -> dict[str, str]:
    """Caps oneDNN's and torch's GEMM caches at `entries` shapes each (0 leaves their defaults),
    unless the environment already sets them; returns what the process now has. Effective
    only before this process's first oneDNN GEMM (the engine calls it first thing on CPU)."""
    if entries > 0:
        for name in GEMM_CACHE_VARIABLES:
            os.environ.setdefault(name, str(entries))
    return {name: os.environ.get(name, "") for name in GEMM_CACHE_VARIABLES}


def share_one_malloc_arena() -> bool:
    """Caps glibc malloc at ARENA_MAX arenas for the threads that have not allocated yet (the
    module docstring); False where the C library is not glibc."""
    libc = _glibc()
    if libc is None:
        return False
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    return libc.mallopt(M_ARENA_MAX, ARENA_MAX) == 1


def release_freed_host_memory() -> bool:
    """Returns the heap's free pages to the kernel (glibc's malloc_trim); False
    where the C library is not glibc."""
    libc = _glibc()
    if libc is None:
        return False
    trim = libc.malloc_trim
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    trim(0)
    return True


MADV_DONTNEED = 4
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def file_mappings(suffix: str = ".safetensors", maps: str = "/proc/self/maps") -> list[tuple[int, int]]:
    """The (start, end) of this process's private mappings of files ending in `suffix` (none
    where /proc is not there): how safetensors maps a checkpoint to load it."""
    try:
        lines = Path(maps).read_text().splitlines()
    except OSError:
        return []
    ranges = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[1].endswith("p") and fields[5].endswith(suffix):
            start, end = (int(value, 16) for value in fields[0].split("-"))
            ranges.append((start, end))
    return ranges


def release_file_pages(address: int, nbytes: int, mappings: list[tuple[int, int]],
                       madvise: Callable[[int, int, int], int] | None = None) -> int:
    """Drops the resident pages wholly inside [address, address + nbytes) where that range
    lies in one of `mappings` (`file_mappings`: the kernel reads them from the file again
    if they are read again); returns the bytes released (0 elsewhere, or without glibc).
    `madvise`: glibc's, looked up once by the caller (`glibc_madvise`) for many calls."""
    start = -(-address // PAGE) * PAGE
    end = (address + nbytes) // PAGE * PAGE
    if end <= start or not any(low <= start and end <= high for low, high in mappings):
        return 0
    madvise = madvise or glibc_madvise()
    if madvise is None:
        return 0
    return end - start if madvise(start, end - start, MADV_DONTNEED) == 0 else 0


class CheckpointPages:
    """The checkpoint files mapped when it was made (`file_mappings`): called with (address,
    bytes), `release_file_pages` over them (glibc looked up once: `find_library` runs
    `ldconfig`); `holds` says whether a tensor still lies in them (a weight not yet copied out)."""

    def __init__(self, mappings: list[tuple[int, int]],
                 madvise: Callable[[int, int, int], int] | None) -> None:
        self._mappings, self._madvise = mappings, madvise

    def __call__(self, address: int, nbytes: int) -> int:
        if self._madvise is None:
            return 0
        return release_file_pages(address, nbytes, self._mappings, self._madvise)

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor`'s first byte lies in one of the mappings (an opaque tensor, a oneDNN
        pack, never does)."""
        if tensor.device.type != "cpu" or tensor.numel() == 0 or tensor.is_mkldnn:
            return False
        address = tensor.data_ptr()
        return any(low <= address < high for low, high in self._mappings)

    def release(self, tensor: torch.Tensor) -> int:
        """Lets go of the mapped pages wholly inside `tensor`'s bytes (a view of the checkpoint
        that was read; the kernel reads them from the file again if it is read again)."""
        if tensor.device.type != "cpu" or tensor.is_mkldnn or not tensor.is_contiguous():
            return 0
        return self(tensor.data_ptr(), tensor.numel() * tensor.element_size())


def checkpoint_page_release() -> CheckpointPages:
    """The checkpoint files mapped now (call after loading, before copying the weights out)."""
    return CheckpointPages(file_mappings(), glibc_madvise())


def glibc_madvise() -> Callable[[int, int, int], int] | None:
    libc = _glibc()
    if libc is None:
        return None
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The C library when it is glibc, else None; looked up once per process: `find_library`
    runs `ldconfig -p` in a child process, which took ~1.4 ms of each release in a served
    worker (the default model loaded, 2-core AMD EPYC)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        libc.mallopt, libc.malloc_trim  # noqa: B018 (both glibc's)
    except (OSError, AttributeError):
        return None
    return libc


def _tune_glibc() -> bool:
    libc = _glibc()
    if libc is None:
        return False
    mallopt = libc.mallopt
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    applied = all(mallopt(option, value) == 1 for option, value in (
        (M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_TOP_PAD, TOP_PAD),
        (M_ARENA_MAX, ARENA_MAX)))
    if applied:
        log.info("host allocator: buffers up to %d MiB stay on the heap, freed memory is kept", MMAP_THRESHOLD >> 20)
    return applied
