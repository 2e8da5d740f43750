"""Quick decode runs (DECODE_STEP_MS) through the real processes (tiny model), one stream at a
time so that nothing waits and runs apply: greedy and seeded streams carry the same tokens with
quick runs as with `DECODE_STEPS`' four a step, end at max_tokens, and take fewer worker steps."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import httpx

from tests.integration.conftest import start_stack
from tests.integration.test_speculative_decoding import BODIES, stream_tokens


def worker_steps(metrics: str) -> float:
    return sum(float(value) for value in re.findall(
        r'fairserve_worker_step_seconds_count\{worker="[^"]+"\} ([0-9.e+]+)', metrics))


async def one_at_a_time(url: str) -> list[tuple[list[int], str]]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        return [await stream_tokens(client, body) for body in BODIES.values()]


def test_quick_runs_change_no_token_and_take_fewer_steps(tiny_model_dir: Path, tmp_path: Path) -> None:
    outputs, steps = {}, {}
    for budget in ("0", "160"):
        stack = start_stack(tmp_path / f"runs{budget}", tiny_model_dir, extra_env={"DECODE_STEP_MS": budget})
        try:
            before = worker_steps(httpx.get(f"http://127.0.0.1:{stack.ports.workers[0][1]}/metrics", timeout=10).text)
            outputs[budget] = asyncio.run(one_at_a_time(stack.url))
            after = worker_steps(httpx.get(f"http://127.0.0.1:{stack.ports.workers[0][1]}/metrics", timeout=10).text)
            steps[budget] = after - before
        finally:
            stack.stop()
    assert outputs["160"] == outputs["0"]
    for (tokens, finish), (name, body) in zip(outputs["160"], BODIES.items()):
        assert len(tokens) == body["max_tokens"] and finish == "length", name
    assert 0 < steps["160"] < steps["0"], steps
