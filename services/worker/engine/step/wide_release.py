"""When a CPU engine hands the memory its wide steps freed back (HOST_MEMORY_RELEASE_ROWS).

A wide step (a prefill chunk of `rows` or more) allocates multi-megabyte buffers, and what it
frees stays in the heap (cpu/host_memory.py) until it is handed back. Handed back after every
wide step, the next wide step faults the same buffers in again: on a concurrency-32 run the
prefill comes in bursts of wide steps back to back (four or five 2,048-token steps as 32
prompts arrive), and each of them paid that. So the release waits for the end of a burst:
the first step after a wide one that is not wide itself (a decode) hands back what the burst
freed, once. The peak is the burst's widest step either way; between the steps of a burst
the worker holds what one of them used (an idle worker's release, idle_release.py, covers a
burst that nothing follows).

    step:     wide  wide  wide  decode  decode  wide  decode
    release:                      ^                     ^
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class WideRelease:
    """`after_step(rows)` says whether the freed memory goes back after a step of `rows` rows.

    Invariant: at most one release per burst of wide steps, and none while no wide step ran
    since the last one. `rows` 0 never releases (the setting's "keep them")."""
    rows: int
    pending: bool = False       # a wide step ran since the last release

    def after_step(self, rows: int) -> bool:
        if self.rows <= 0:
            return False
        if rows >= self.rows:
            self.pending = True
            return False
        released, self.pending = self.pending, False
        return released

    def released_elsewhere(self) -> None:
        """A quiet point handed everything back (Engine.release_host_memory)."""
        self.pending = False
