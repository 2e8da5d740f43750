"""Resident memory of a served system's services while a point runs.

A `ResidentSampler` reads each service's resident bytes (its whole process tree:
benchmarks.memory) every `interval_s` on a thread of its own while the point's
requests run, and `finish` takes one last reading and returns a `Resident`:

* peak_mb: per service, the highest reading during the point;
* end_mb: per service, the reading as the point ended (what stays resident);
* peak_total_mb: the highest sum over the services of one round of readings
  (not the sum of the per-service peaks, which need not coincide).

fairserve's services are its gateway, scheduler, worker(s) and kvcache; a peer is
one service, its server's process tree (vLLM's API server with its engine core,
llama-server, transformers serve).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from benchmarks.memory import MB, tree_resident_bytes

ReadBytes = Callable[[int], int]        # pid -> resident bytes of its process tree (0 once gone)


@dataclass(frozen=True)
class Resident:
    peak_mb: dict[str, float]
    end_mb: dict[str, float]
    peak_total_mb: float
    samples: int


class ResidentSampler:
    def __init__(self, services: Mapping[str, int], interval_s: float = 0.25,
                 read: ReadBytes = tree_resident_bytes) -> None:
        self._services = dict(services)
        self._interval_s = interval_s
        self._read = read
        self._peak = dict.fromkeys(self._services, 0.0)
        self._last = dict.fromkeys(self._services, 0.0)
        self._peak_total = 0.0
        self._samples = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> None:
        """One round of readings, folded into the peaks."""
        reading = {name: self._read(pid) / MB for name, pid in self._services.items()}
        for name, value in reading.items():
            self._peak[name] = max(self._peak[name], value)
        self._last = reading
        self._peak_total = max(self._peak_total, sum(reading.values()))
        self._samples += 1

    def start(self) -> ResidentSampler:
        """Samples now, then every `interval_s` on a background thread until `finish`."""
        self.sample()
        self._thread = threading.Thread(target=self._run, name="resident-sampler", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.sample()

    def finish(self) -> Resident:
        """Stops the thread, takes the closing reading, returns what was seen."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()
        return Resident(peak_mb=dict(self._peak), end_mb=dict(self._last), peak_total_mb=self._peak_total,
                        samples=self._samples)


def render_services(values: Mapping[str, float]) -> str:
    """`gateway 612 · worker-0 3,080`, in the services' order; `—` for none."""
    return " · ".join(f"{name} {value:,.0f}" for name, value in values.items()) or "—"
