"""The default model served end to end; greedy output equals transformers'."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from fairserve.launcher.stack import Stack, StackPorts
from tests.integration.helpers import stream_generate
from tests.integration.test_foundation import reference_greedy

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def real_stack(real_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    env = {"MODEL_NAME": str(real_model_dir), "KV_CACHE_NUM_BLOCKS": "256", "LOG_LEVEL": "info"}
    stack = Stack(ports=StackPorts.free(1), env=env, log_dir=tmp_path_factory.mktemp("real") / "logs")
    stack.start(timeout_s=300)
    yield stack
    stack.stop()


def test_default_model_greedy_parity(real_stack: Stack, real_model_dir: Path) -> None:
    prompt = "The capital of France is"
    expected = reference_greedy(real_model_dir, prompt, 20)
    events = stream_generate(real_stack.url, {"prompt": prompt, "max_tokens": 20, "raw": True},
                             timeout=300)
    got = [e["token_id"] for e in events if "token_id" in e]
    assert got == expected
    text = "".join(e["token"] for e in events if "token" in e)
    assert text.strip() and "France" in text
