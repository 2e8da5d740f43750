"""The idle worker's release of freed memory (services/worker/host/idle_release.py): once per idle
spell, only after a step and only `delay_s` after the last one, never while steps keep coming,
run through the engine's thread; the worker's after-step hook keeps the thread pacer's call;
and, on the real allocator, a burst's freed buffers leave the process."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from services.worker.engine.cpu import host_memory
from services.worker.host.idle_release import IdleRelease
from services.worker.main import _after_step
from services.worker.settings import WorkerSettings


@dataclass
class Clock:
    """Seconds that pass only when a test moves `now`."""
    now: float = 100.0

    def __call__(self) -> float:
        return self.now


def test_it_releases_once_an_idle_spell_after_the_delay() -> None:
    clock, released = Clock(), []
    idle = IdleRelease(5.0, lambda: released.append(clock.now), clock)
    clock.now += 60
    assert not idle.release_if_idle()           # no step since start: nothing kept to hand back
    idle.stepped()
    clock.now += 4.9
    assert not idle.release_if_idle()
    clock.now += 0.2
    assert idle.release_if_idle() and released == [165.1]
    clock.now += 60
    assert not idle.release_if_idle()           # once per idle spell
    for _ in range(10):                         # steps every second: never idle long enough
        idle.stepped()
        clock.now += 1
        assert not idle.release_if_idle()
    clock.now += 4
    assert idle.release_if_idle() and idle.releases == 2


def test_it_runs_the_release_on_the_engine_thread() -> None:
    clock, ran_on = Clock(), []
    idle = IdleRelease(0.2, lambda: None, clock)

    async def on_engine_thread(function):
        ran_on.append("engine thread")
        return function()

    async def main() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(idle.run(on_engine_thread, stop))
        idle.stepped()
        clock.now += 1
        await asyncio.sleep(0.2)
        stop.set()
        await task

    asyncio.run(main())
    assert ran_on == ["engine thread"] and idle.releases == 1


def test_the_after_step_hook_keeps_the_pacers_call() -> None:
    clock, paced = Clock(), []
    idle = IdleRelease(5.0, lambda: None, clock)
    hook = _after_step(lambda rows, wall: paced.append((rows, wall)), idle)
    hook(3, 0.01)
    assert paced == [(3, 0.01)] and not idle.due()
    clock.now += 5
    assert idle.due()
    assert _after_step(None, None) is None
    alone = _after_step(None, idle)
    alone(0, 0.5)


def test_the_setting_reads_and_refuses_negative_delays() -> None:
    assert WorkerSettings.from_env({"MODEL_NAME": "x"}).idle_release_s == 5.0
    assert WorkerSettings.from_env({"MODEL_NAME": "x", "HOST_MEMORY_IDLE_RELEASE_S": "0"}).idle_release_s == 0
    with pytest.raises(Exception, match="HOST_MEMORY_IDLE_RELEASE_S"):
        WorkerSettings.from_env({"MODEL_NAME": "x", "HOST_MEMORY_IDLE_RELEASE_S": "-1"})


def _resident_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="needs /proc (Linux)")
def test_a_bursts_freed_buffers_leave_the_process() -> None:
    if not host_memory.keep_freed_host_memory():
        pytest.skip("not glibc")
    # 512 MiB of 4 MB buffers, each kept once freed (below the 1 GiB at which glibc would trim
    # the heap's top by itself, whatever the heap held before)
    buffers = [torch.ones(1 << 20) for _ in range(128)]
    del buffers
    kept = _resident_mb()
    idle = IdleRelease(0.0, host_memory.release_freed_host_memory)
    idle.stepped()
    assert idle.release_if_idle()
    assert _resident_mb() < kept - 250
