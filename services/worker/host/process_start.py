"""What a worker process sets before torch loads and before its first thread starts.

`python -m services.worker.main` and `fairserve worker` call `prepare_process` first thing;
a test or benchmark that builds an engine in its own process does without.

- OpenMP's spin at a barrier is bounded (GOMP_SPINCOUNT, 20,000 rounds unless the environment
  sets it; libgomp's default is 300,000). libgomp reads the variable once, when torch loads it.
  A team that spins long collapses when another process takes one of its cores: each barrier
  then waits out the other's time slice (on 2 vCPUs, a tenant flooding the gateway stretched
  another's longest gap between tokens from 45 ms to 1.4 s; with the bound, 0.2 s;
  docs/benchmarks.md, Isolation). OMP_WAIT_POLICY=PASSIVE (no spinning) protects as well but
  costs about a third of batch-1 decode speed.
- Every thread allocates from one glibc malloc arena (engine/cpu/host_memory.py,
  `share_one_malloc_arena`). A thread takes its arena at its first allocation, so the cap must
  come before the engine's thread starts: the engine builds and steps there, and in an arena of
  its own what it freed at the top of that arena's heap stayed resident (malloc_trim gives back
  only the main arena's top): 24 MB more on the default model, a served worker at 586 MB after
  its build against 562.
"""

from __future__ import annotations

import os

from services.worker.engine.cpu.host_memory import share_one_malloc_arena

GOMP_SPINCOUNT = "20000"


def prepare_process() -> None:
    os.environ.setdefault("GOMP_SPINCOUNT", GOMP_SPINCOUNT)
    share_one_malloc_arena()
