"""When a CPU engine hands the memory its wide steps freed back (HOST_MEMORY_RELEASE_ROWS).

A wide step (a prefill chunk of `rows` or more) allocates multi-megabyte buffers, and what it
frees stays in the heap (cpu/host_memory.py) until it is handed back. Handed back after every
wide step, the next wide step faults the same buffers in again: on a concurrency-32 run the
prefill comes in bursts of wide steps back to back (four or five 2,048-token steps as 32
prompts arrive), and each of them paid that. So the release waits for the end of a burst:
the first step after a wide one that is not wide itself and decodes (a sequence computing
past its prompt) hands back what the burst freed, once. The peak is the burst's widest step
either way; between the steps of a burst the worker holds what one of them used (an idle
worker's release, idle_release.py, covers a burst that nothing follows). A load of wide steps
alone (prompts scored, or arriving faster than they decode) would keep them for good, and wide
steps of other sizes land elsewhere in the heap: so a burst also hands back after every
`max_burst` wide steps in a row.

    step:     wide  wide  wide  decode  decode  wide  decode
    release:                      ^                     ^

A narrow step of prompt tokens alone (a cached prompt's last few tokens, a short prompt) does
not end a burst: the release (malloc_trim, ~7-10 ms after a 1.5k-token prefill, holding the
malloc lock every thread allocates under) would land in that step, on the first token of a
prompt that shares a prefix with the one just prefilled, the case prefix caching makes fast.
A worker left with no running sequence hands it back once no step has come for
HOST_MEMORY_QUIET_RELEASE_S (`Engine.release_wide_step_memory`, services/worker/server.py).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class WideRelease:
    """`after_step(rows, decodes)` says whether the freed memory goes back after a step of
    `rows` rows (`decodes`: some of them past a sequence's prompt).

    Invariant: no release while no wide step ran since the last one; one at the end of a
    burst (the first step with rows that is not wide and decodes), and within it one per
    `max_burst` wide steps. `rows` 0 never releases (the setting's "keep them"); nor does a
    step of no rows (it only freed sequences) or a narrow one of prompt tokens alone: a worker
    left with none running releases once it is quiet instead (services/worker/server.py)."""
    rows: int
    max_burst: int = 8
    pending: int = 0            # wide steps since the last release

    def after_step(self, rows: int, decodes: bool = True) -> bool:
        if self.rows <= 0 or rows <= 0:     # a step that computed nothing (frees alone) ends no burst
            return False
        if rows >= self.rows:
            self.pending += 1
            if self.pending < self.max_burst:
                return False
        elif not decodes:                   # a few prompt tokens: the burst may go on
            return False
        released, self.pending = self.pending > 0, 0
        return released

    def released_elsewhere(self) -> None:
        """A quiet point handed everything back (Engine.release_host_memory)."""
        self.pending = 0
