"""Integration fixtures: the four services as real processes on free ports."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from common.model_store import default_cache_dir, default_model_dir, is_prepared
from fairserve.launcher.stack import Stack, StackPorts
from tests.fixtures.tiny_model import save_tiny_model

TINY_ENV = {
    "KV_CACHE_BLOCK_SIZE": "4",
    "KV_CACHE_NUM_BLOCKS": "512",
    "MAX_BATCH_SIZE": "8",
    "PREFILL_CHUNK_SIZE": "16",
    "TORCH_THREADS": "1",
    "WORKER_HEARTBEAT_INTERVAL_S": "0.5",
    "LOG_LEVEL": "info",
    # Many checks here run while a greedy stream is still going, counted in steps; speculative
    # drafts (on by default for one or two greedy streams) let the tiny model's repetitive text
    # end a stream in a few. test_speculative_decoding.py turns them on.
    "SPECULATIVE_TOKENS": "0",
    # Quick runs would do the same: the tiny model's runs take a millisecond or two, so
    # a lone stream would take up to 64 of them a step. test_quick_runs.py turns them on.
    "DECODE_STEP_MS": "0",
}


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny-gemma3"))


def start_stack(tmp_path: Path, model_dir: Path, num_workers: int = 1,
                extra_env: dict[str, str] | None = None) -> Stack:
    env = {**TINY_ENV, "MODEL_NAME": str(model_dir), **(extra_env or {})}
    stack = Stack(ports=StackPorts.free(num_workers), env=env, log_dir=tmp_path / "logs")
    return stack.start(timeout_s=180)


@pytest.fixture(scope="module")
def tiny_stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = start_stack(tmp_path_factory.mktemp("stack"), tiny_model_dir)
    yield stack
    stack.stop()


@pytest.fixture(scope="session")
def real_model_dir() -> Path:
    path = default_model_dir(default_cache_dir())
    if not is_prepared(path):
        pytest.skip("default model not prepared (run `make prepare-model`)")
    return path
