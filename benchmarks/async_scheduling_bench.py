"""Async scheduling on and off, side by side, on real service processes.

    python -m benchmarks.async_scheduling_bench            # tiny model, 2 rounds of 20 s per mode
    python -m benchmarks.async_scheduling_bench --model default
    python -m benchmarks.async_scheduling_bench --quick    # checks the script (seconds)

Each run starts the whole stack (gateway, scheduler, one worker, kvcache) with
ASYNC_SCHEDULING=false or true, drives it with the load simulator (users with no
think time, so the batch stays full), and reads the worker's metrics: steps, the
worker's time inside steps, and the wall time per step. The modes alternate
(off, on, off, on, ...) so that a drift of the machine hits both. On the tiny
model a step's forward takes a few milliseconds, about what the stack spends
around it (HTTP streaming, scheduling, two gRPC hops), which is the regime of a
small model on a GPU. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

import httpx

from common.model_store import default_cache_dir, default_model_dir, is_prepared
from loadsim.drive import drive_closed_loop
from loadsim.stats import summarize
from loadsim.workload import parse_workload
from fairserve.launcher.stack import Stack, StackPorts

WORKLOAD = parse_workload({
    "templates": [{"name": "short", "prompts": ["Hello there, how are you today?", "Once upon a time",
                                               "The capital of France is", "def add(a, b):"],
                   "max_tokens": [40, 60], "temperature": 0.8}],
    "users": [{"name": "busy", "think_time_s": 0.0, "think_jitter": 0.0}],
})
STEP_METRIC = re.compile(r"^fairserve_worker_step_seconds_(sum|count)\{[^}]*\} ([0-9.e+-]+)$", re.M)


@dataclass(frozen=True)
class RunResult:
    async_scheduling: bool
    output_tokens_per_s: float
    tpot_p50_ms: float | None
    steps: int
    step_ms: float          # the worker's time inside a step
    wall_per_step_ms: float


def worker_step_totals(metrics_url: str) -> tuple[float, float]:
    values = {kind: float(value) for kind, value in STEP_METRIC.findall(httpx.get(metrics_url, timeout=10).text)}
    return values.get("sum", 0.0), values.get("count", 0.0)


async def drive(url: str, users: int, seconds: float, seed: int) -> tuple[float, float | None, float]:
    result = await drive_closed_loop(url, WORKLOAD, users, seconds, seed)
    summary = summarize(result.records, result.duration_s)
    failed = summary.requests - summary.outcomes.get("ok", 0)
    if failed:
        raise RuntimeError(f"{failed} of {summary.requests} requests failed: {summary.outcomes}")
    tpot = summary.tpot_s.p50
    return summary.output_tokens_per_s, None if tpot is None else tpot * 1000, result.duration_s


def one_run(model_dir: Path, async_scheduling: bool, users: int, seconds: float, seed: int,
            log_dir: Path, torch_threads: int) -> RunResult:
    env = {"MODEL_NAME": str(model_dir), "ASYNC_SCHEDULING": str(async_scheduling).lower(),
           "MAX_BATCH_SIZE": str(max(users, 8)), "LOG_LEVEL": "warning"}
    if torch_threads:
        env["TORCH_THREADS"] = str(torch_threads)
    stack = Stack(ports=StackPorts.free(1), env=env, log_dir=log_dir).start(timeout_s=600)
    try:
        metrics_url = f"http://127.0.0.1:{stack.ports.workers[0][1]}/metrics"
        asyncio.run(drive(stack.url, users, min(seconds, 2.0), seed))      # warm-up
        busy_before, steps_before = worker_step_totals(metrics_url)
        rate, tpot_ms, wall = asyncio.run(drive(stack.url, users, seconds, seed + 1))
        busy_after, steps_after = worker_step_totals(metrics_url)
    finally:
        stack.stop()
    steps = int(steps_after - steps_before)
    return RunResult(async_scheduling, rate, tpot_ms, steps, (busy_after - busy_before) / max(steps, 1) * 1000,
                     wall / max(steps, 1) * 1000)


def render(results: list[RunResult], header: str) -> str:
    lines = [header, "", "| run | ASYNC_SCHEDULING | output tok/s | TPOT p50 ms | steps | worker ms/step | wall ms/step |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    for index, r in enumerate(results, 1):
        tpot = "—" if r.tpot_p50_ms is None else f"{r.tpot_p50_ms:.1f}"
        lines.append(f"| {index} | {'true' if r.async_scheduling else 'false'} | {r.output_tokens_per_s:,.1f} | "
                     f"{tpot} | {r.steps} | {r.step_ms:.2f} | {r.wall_per_step_ms:.2f} |")
    on = [r.output_tokens_per_s for r in results if r.async_scheduling]
    off = [r.output_tokens_per_s for r in results if not r.async_scheduling]
    pairs = [f"{b / a:.2f}x" for a, b in zip(off, on) if a > 0]
    lines += ["", f"Output tokens/s, async on over off, per round: {', '.join(pairs)}; "
                  f"medians {statistics.median(on):,.1f} vs {statistics.median(off):,.1f} "
                  f"({statistics.median(on) / statistics.median(off):.2f}x)."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("tiny", "default"), default="tiny")
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=20.0, help="measured seconds per run")
    parser.add_argument("--rounds", type=int, default=2, help="pairs of runs (off, on)")
    parser.add_argument("--quick", action="store_true", help="one short round: checks the script")
    args = parser.parse_args(argv)
    if args.quick:
        args.seconds, args.rounds, args.users = 2.0, 1, 4
    with tempfile.TemporaryDirectory(prefix="async-bench-") as scratch:
        if args.model == "tiny":
            from tests.fixtures.tiny_model import save_tiny_model
            model_dir = save_tiny_model(Path(scratch) / "tiny")
        else:
            model_dir = default_model_dir(default_cache_dir())
            if not is_prepared(model_dir):
                raise SystemExit("default model not prepared: run `make prepare-model` first")
        results = []
        for round_index in range(args.rounds):
            for mode in (False, True):
                results.append(one_run(model_dir, mode, args.users, args.seconds, seed=round_index,
                                       log_dir=Path(scratch) / f"logs-{round_index}-{mode}",
                                       torch_threads=1 if args.model == "tiny" else 0))
    header = (f"Async scheduling benchmark ({'quick' if args.quick else 'full'}): {args.model} model, "
              f"{args.users} users with no think time, {args.seconds:g} s per run, {os.cpu_count()} CPUs, "
              f"worker torch threads: {'1' if args.model == 'tiny' else 'default'}.")
    print(render(results, header))


if __name__ == "__main__":
    main()
