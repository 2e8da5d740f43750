"""Fairness through the gateway: a heavy client keeps many requests in flight
while a light client sends one request at a time; we compare the light
client's TTFT under fcfs and vtc with its TTFT on an otherwise idle system.

    python -m benchmarks.fairness_bench            # default model, MAX_BATCH_SIZE=8
    python -m benchmarks.fairness_bench --quick    # tiny model, checks the script

Every policy runs on a freshly started stack, one after another, in one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks.machine import cpu_name
from common.model_store import default_cache_dir, default_model_dir, is_prepared
from scripts.stack import Stack, StackPorts

WORDS = ("river", "stone", "market", "signal", "garden", "engine", "harbor", "lantern", "orbit",
         "canvas", "meadow", "copper", "thunder", "velvet", "summit", "anchor")


@dataclass(frozen=True)
class Load:
    heavy_in_flight: int
    prompt_words: int
    max_tokens: int
    light_requests: int
    idle_requests: int


FULL = Load(heavy_in_flight=32, prompt_words=60, max_tokens=48, light_requests=6, idle_requests=5)
QUICK = Load(heavy_in_flight=8, prompt_words=12, max_tokens=8, light_requests=4, idle_requests=2)


def prompt(index: int, words: int) -> str:
    return " ".join(WORDS[(index * 7 + i) % len(WORDS)] for i in range(words)) + f" #{index}"


async def timed_request(client: httpx.AsyncClient, user: str, text: str, max_tokens: int) -> float:
    """Streams one raw completion; returns the time to its first token."""
    body = {"prompt": text, "max_tokens": max_tokens, "raw": True, "stream": True, "user": user,
            "ignore_eos": True}
    started = time.perf_counter()
    ttft = float("nan")
    async with client.stream("POST", "/generate", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and "token_id" in json.loads(line[6:]) and ttft != ttft:
                ttft = time.perf_counter() - started
    return ttft


async def heavy_client(client: httpx.AsyncClient, load: Load, stop: asyncio.Event) -> int:
    done = 0

    async def lane(lane_index: int) -> None:
        nonlocal done
        index = lane_index
        while not stop.is_set():
            await timed_request(client, "heavy", prompt(1000 + index, load.prompt_words), load.max_tokens)
            done += 1
            index += load.heavy_in_flight

    await asyncio.gather(*(lane(i) for i in range(load.heavy_in_flight)))
    return done


async def light_client(client: httpx.AsyncClient, load: Load, count: int) -> list[float]:
    return [await timed_request(client, "light", prompt(i, load.prompt_words), load.max_tokens)
            for i in range(count)]


async def measure(url: str, load: Load, contended: bool) -> tuple[list[float], int]:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await light_client(client, load, 1)  # warm-up
        if not contended:
            return await light_client(client, load, load.idle_requests), 0
        stop = asyncio.Event()
        heavy = asyncio.create_task(heavy_client(client, load, stop))
        await asyncio.sleep(3.0)  # let the heavy client's queue form
        ttfts = await light_client(client, load, load.light_requests)
        stop.set()
        return ttfts, await heavy


def run_policy(model_dir: Path, policy: str, load: Load, contended: bool, logs: Path) -> tuple[list[float], int]:
    env = {"MODEL_NAME": str(model_dir), "SCHEDULING_POLICY": policy, "MAX_BATCH_SIZE": "8",
           "MAX_QUEUE_LEN": "4096", "QUEUE_TIMEOUT_S": "600", "LOG_LEVEL": "warning"}
    stack = Stack(ports=StackPorts.free(1), env=env, log_dir=logs / f"{policy}-{contended}")
    stack.start(timeout_s=600)
    try:
        return asyncio.run(measure(stack.url, load, contended))
    finally:
        stack.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny model, small load")
    args = parser.parse_args()
    load = QUICK if args.quick else FULL
    with tempfile.TemporaryDirectory() as scratch:
        if args.quick:
            from tests.fixtures.tiny_model import save_tiny_model
            model_dir = save_tiny_model(Path(scratch) / "tiny")
        else:
            model_dir = default_model_dir(default_cache_dir())
            if not is_prepared(model_dir):
                raise SystemExit("default model not prepared: run `make prepare-model`")
        logs = Path(scratch) / "logs"
        idle, _ = run_policy(model_dir, "fcfs", load, contended=False, logs=logs)
        rows = [("idle (no heavy client)", idle, 0)]
        for policy in ("fcfs", "vtc"):
            ttfts, heavy_done = run_policy(model_dir, policy, load, contended=True, logs=logs)
            rows.append((f"{policy}, heavy client {load.heavy_in_flight} in flight", ttfts, heavy_done))
    idle_median = statistics.median(idle)
    print(f"\nmodel: {'tiny' if args.quick else 'gemma-3-270m'}; MAX_BATCH_SIZE=8; prompts ~"
          f"{load.prompt_words} words, {load.max_tokens} new tokens; {cpu_name()}")
    print("\n| setting | light client TTFT median (s) | p90 (s) | × idle median | heavy requests done |")
    print("|---|---|---|---|---|")
    for name, ttfts, heavy_done in rows:
        ordered = sorted(ttfts)
        p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
        median = statistics.median(ordered)
        print(f"| {name} | {median:.3f} | {p90:.3f} | {median / idle_median:.2f} | {heavy_done} |")


if __name__ == "__main__":
    main()
