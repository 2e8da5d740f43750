"""When a CPU engine tunes its allocator and hands memory back: the tuning only once the model is
loaded and prepared; after a step of HOST_MEMORY_RELEASE_ROWS rows or more the heap's freed pages
(never after narrower steps, never with the setting at 0); at its quiet points
(`release_host_memory`) the freed pages and the libraries' clean pages."""

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


def _prefill_then_decode(engine: Engine, prompt_len: int) -> None:
    engine.step(StepBatch(new_sequences=[NewSequence("a", prompt_of(prompt_len))], work=[WorkItem("a", prompt_len)]))
    engine.step(StepBatch(work=[WorkItem("a", 1)]))


@pytest.mark.parametrize("release_rows,prompt_len,expected", [
    (16, 20, ["heap"]),    # a 20-row prefill hands back; the one-row decode after it does not
    (16, 15, []),          # a step just under the rows keeps it
    (0, 40, []),           # 0: never
])
def test_a_wide_step_hands_its_freed_memory_back(release_rows: int, prompt_len: int, expected: list[str]) -> None:
    calls: list[str] = []
    engine = _engine(release_rows, calls)
    calls.clear()                      # what preparation released
    _prefill_then_decode(engine, prompt_len)
    assert calls == expected


def test_the_allocator_is_tuned_after_preparation_and_quiet_points_release_both() -> None:
    calls: list[str] = []
    engine = _engine(0, calls)
    # Loading ran untuned; preparation's freed memory goes back, then the tuning, then the
    # libraries' start-up pages.
    assert calls[:3] == ["heap", "tune", "libraries"]
    calls.clear()
    engine.release_host_memory()
    assert calls == ["heap", "libraries"]
