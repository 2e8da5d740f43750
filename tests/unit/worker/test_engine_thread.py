"""The engine thread builds its engine on the thread its steps run on (one OpenMP team)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from services.worker.server import EngineThread
from tests.unit.worker.engine_helpers import make_engine


def test_the_engine_is_built_on_the_thread_that_runs_it() -> None:
    built_on: list[int] = []

    def make():
        built_on.append(threading.get_ident())
        return make_engine("gemma3", num_blocks=16, block_size=4)

    async def scenario() -> tuple[int, int]:
        thread = await EngineThread.build(make)
        try:
            return await thread.run(threading.get_ident), thread.engine.info.num_blocks
        finally:
            thread.shutdown()

    runs_on, blocks = asyncio.run(scenario())
    assert built_on == [runs_on] and runs_on != threading.get_ident() and blocks == 16


def test_an_engine_thread_without_an_engine_says_so() -> None:
    thread = EngineThread()
    with pytest.raises(RuntimeError, match="no engine yet"):
        thread.engine  # noqa: B018
    thread.shutdown()
