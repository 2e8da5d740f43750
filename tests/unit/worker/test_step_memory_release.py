"""When a CPU engine tunes its allocator and hands memory back: the tuning only once the model is
loaded and prepared; the heap's freed pages once after a burst of steps of HOST_MEMORY_RELEASE_ROWS
rows or more, at the first narrower step after it that decodes (never after narrow steps alone,
never at a narrow step of prompt tokens alone, never with the setting at 0); at its quiet points (`release_host_memory`) the freed pages and the libraries'
clean pages; between steps (`release_wide_step_memory`, a worker's moment with no step waiting) the
wide steps' freed pages when a wide step ran since the last release, and then not again; a step
that only frees sequences leaves the release to that. The burst rule's own arithmetic:
test_wide_release.py."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from common.step import NewSequence, StepBatch, WorkItem
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.wiring import device_accelerators
from tests.fixtures.tiny_model import build_model
from tests.unit.worker.engine_helpers import CONFIGS, prompt_of


def _engine(release_rows: int, calls: list[str]) -> Engine:
    accelerators = dataclasses.replace(device_accelerators(),
                                       keep_freed_host_memory=lambda: calls.append("tune"),
                                       release_freed_host_memory=lambda: calls.append("heap"),
                                       release_library_pages=lambda: calls.append("libraries"))
    model = build_model(copy.deepcopy(CONFIGS["llama"]()))
    config = EngineConfig(model_dir="", num_blocks=64, block_size=4, model_key="llama",
                          host_memory_release_rows=release_rows)
    return Engine(config, model=model, accelerators=accelerators)


def _step(engine: Engine, calls: list[str], batch: StepBatch) -> list[str]:
    """What `batch`'s step released."""
    calls.clear()
    engine.step(batch)
    return list(calls)


@pytest.mark.parametrize("release_rows,prompt_len,expected", [
    (16, 20, ["heap"]),    # a 20-row prefill keeps its memory; the one-row decode after it hands it back
    (16, 15, []),          # a step just under the rows is no burst
    (0, 40, []),           # 0: never
])
def test_a_wide_step_hands_its_freed_memory_back_after_it(release_rows: int, prompt_len: int,
                                                           expected: list[str]) -> None:
    calls: list[str] = []
    engine = _engine(release_rows, calls)
    assert _step(engine, calls, StepBatch(new_sequences=[NewSequence("a", prompt_of(prompt_len))],
                                          work=[WorkItem("a", prompt_len)])) == []
    assert _step(engine, calls, StepBatch(work=[WorkItem("a", 1)])) == expected
    assert _step(engine, calls, StepBatch(work=[WorkItem("a", 1)])) == []    # once


def test_wide_steps_back_to_back_release_once_after_the_burst() -> None:
    calls: list[str] = []
    engine = _engine(16, calls)
    prompts = {name: prompt_of(20, salt=i + 1) for i, name in enumerate("abc")}   # nothing cached
    for name, prompt in prompts.items():       # three prefills, each step wide
        assert _step(engine, calls, StepBatch(new_sequences=[NewSequence(name, prompt)],
                                              work=[WorkItem(name, len(prompt))])) == []
    decode = StepBatch(work=[WorkItem(name, 1) for name in prompts])
    assert _step(engine, calls, decode) == ["heap"]
    assert _step(engine, calls, dataclasses.replace(decode)) == []


def test_a_short_prompt_after_a_burst_leaves_the_release_to_a_decode() -> None:
    """A narrow step of prompt tokens alone (a cached prompt's last few, a short prompt) does not
    pay the burst's release: the first step that decodes does."""
    calls: list[str] = []
    engine = _engine(16, calls)
    _step(engine, calls, StepBatch(new_sequences=[NewSequence("a", prompt_of(20))], work=[WorkItem("a", 20)]))
    short = prompt_of(6, salt=7)
    assert _step(engine, calls, StepBatch(new_sequences=[NewSequence("b", short)],
                                          work=[WorkItem("b", len(short))])) == []
    assert engine.holds_wide_step_memory
    assert _step(engine, calls, StepBatch(work=[WorkItem("a", 1), WorkItem("b", 1)])) == ["heap"]


def test_a_quiet_point_takes_the_bursts_release() -> None:
    calls: list[str] = []
    engine = _engine(16, calls)
    _step(engine, calls, StepBatch(new_sequences=[NewSequence("a", prompt_of(20))], work=[WorkItem("a", 20)]))
    engine.release_host_memory()               # the idle worker's release
    assert _step(engine, calls, StepBatch(work=[WorkItem("a", 1)])) == []


@pytest.mark.parametrize("prompt_len,released", [(20, ["heap"]), (15, [])])
def test_between_steps_a_wide_steps_memory_goes_back_once(prompt_len: int, released: list[str]) -> None:
    calls: list[str] = []
    engine = _engine(16, calls)
    _step(engine, calls, StepBatch(new_sequences=[NewSequence("a", prompt_of(prompt_len))],
                                   work=[WorkItem("a", prompt_len)]))
    assert engine.holds_wide_step_memory is bool(released)
    calls.clear()
    assert engine.release_wide_step_memory() is bool(released)
    assert calls == released and not engine.holds_wide_step_memory
    assert engine.release_wide_step_memory() is False and calls == released     # once
    assert _step(engine, calls, StepBatch(work=[WorkItem("a", 1)])) == []       # the burst's release was taken


def test_a_step_that_only_frees_leaves_the_release_to_the_worker() -> None:
    calls: list[str] = []
    engine = _engine(16, calls)
    _step(engine, calls, StepBatch(new_sequences=[NewSequence("a", prompt_of(20))], work=[WorkItem("a", 20)]))
    assert _step(engine, calls, StepBatch(free_seq_ids=["a"], work=[])) == []
    assert engine.holds_wide_step_memory and engine.running_sequences() == 0
    calls.clear()
    assert engine.release_wide_step_memory() and calls == ["heap"]


def test_with_the_setting_at_0_nothing_is_held_between_steps() -> None:
    calls: list[str] = []
    engine = _engine(0, calls)
    _step(engine, calls, StepBatch(new_sequences=[NewSequence("a", prompt_of(40))], work=[WorkItem("a", 40)]))
    assert not engine.holds_wide_step_memory and engine.release_wide_step_memory() is False


def test_the_allocator_is_tuned_after_preparation_and_quiet_points_release_both() -> None:
    calls: list[str] = []
    engine = _engine(0, calls)
    # Loading ran untuned; preparation's freed memory goes back, then the tuning, then the
    # libraries' start-up pages.
    assert calls[:3] == ["heap", "tune", "libraries"]
    calls.clear()
    engine.release_host_memory()
    assert calls == ["heap", "libraries"]
