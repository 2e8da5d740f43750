"""The worker's wait between steps in a served W1 run: the whole stack (gateway,
scheduler with its defaults, async scheduling on; one worker; kvcache), `concurrency`
W1 requests sent at once through the gateway (streamed, greedy, exactly `new_tokens`
each), and the worker's and the scheduler's step histograms read from their
Prometheus endpoints before and after.

* forward: the worker's `fairserve_worker_step_seconds` (the engine's forward and
  sampling of each step, `StepOutput.forward_ms`);
* the rest of each engine step (planning, commit, the engine's own Python) is not in
  that histogram: `engine_outside_forward_ms` (per step, from the in-process profile's
  decode-only steps) stands in for it;
* waiting: the run's wall time less both, i.e. the time the engine thread had no
  step to run (gRPC, the step's protobuf conversion, the scheduler's planning when it
  is not hidden behind the step in flight).

And the CPU seconds each service (and this client) spent during the run: on a
machine with as many cores as the worker has threads, every second another
process runs is taken from the worker's steps.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.cpu_time import CpuMeter, client_meter
from benchmarks.head_to_head.sweep import Driver, Plan, warm_up
from benchmarks.head_to_head.systems import Served
from benchmarks.head_to_head.workload import unique_requests
from common.observability import prometheus_names as names
from fairserve.launcher.stack import Stack, StackPorts


@dataclass(frozen=True)
class Histogram:
    count: float
    total_s: float


def read_histogram(text: str, family: str) -> Histogram:
    """The count and sum of `family` (every label set together) in a /metrics text."""
    count = total = 0.0
    for metric in text_string_to_metric_families(text):
        for sample in metric.samples:
            if sample.name == family + "_count":
                count += sample.value
            elif sample.name == family + "_sum":
                total += sample.value
    return Histogram(count, total)


def _scrape(port: int, family: str) -> Histogram:
    return read_histogram(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text, family)


@dataclass(frozen=True)
class ServedSteps:
    wall_s: float
    steps: float
    forward_s: float
    rpc_s: float          # the scheduler's step round trips (send to reply), summed; they overlap
    tokens: int
    cpu_s: dict[str, float] = field(default_factory=dict)   # per service and the client, during the run

    def table(self, engine_outside_forward_ms: float) -> str:
        outside = self.steps * engine_outside_forward_ms / 1000
        waiting = self.wall_s - self.forward_s - outside
        rows = [("engine forward + sampling (worker histogram)", self.forward_s),
                ("engine planning, commit, Python (profile's per-step figure x steps)", outside),
                ("worker waits for its next step (the rest)", waiting)]
        lines = [f"Served W1: {self.tokens} output tokens in {self.wall_s:.2f} s "
                 f"({self.tokens / self.wall_s:.1f} tokens/s), {self.steps:.0f} worker steps, "
                 f"{self.wall_s / max(self.steps, 1) * 1000:.1f} ms of wall time per step; the scheduler's step "
                 f"round trips (send to reply) sum to {self.rpc_s:.2f} s.", "",
                 "| worker time | s | ms per step | share |", "|---|---:|---:|---:|"]
        lines += [f"| {name} | {seconds:.2f} | {seconds / max(self.steps, 1) * 1000:.1f} | "
                  f"{seconds / self.wall_s:.1%} |" for name, seconds in rows]
        if self.cpu_s:
            lines += ["", self.cpu_table()]
        return "\n".join(lines)

    def cpu_table(self, cores: int | None = None) -> str:
        """CPU seconds per process tree against the run's wall time times the cores."""
        cores = cores or os.cpu_count() or 1
        capacity = self.wall_s * cores
        lines = [f"CPU time during the run ({cores} cores x {self.wall_s:.2f} s = {capacity:.2f} CPU s):", "",
                 "| process | CPU s | share of the cores |", "|---|---:|---:|"]
        lines += [f"| {name} | {seconds:.2f} | {seconds / capacity:.1%} |" for name, seconds in self.cpu_s.items()]
        idle = capacity - sum(self.cpu_s.values())
        lines.append(f"| (none of these) | {idle:.2f} | {idle / capacity:.1%} |")
        return "\n".join(lines)


async def _drive(stack: Stack, model: str, concurrency: int, new_tokens: int, short: bool) -> ServedSteps:
    services = {name: process.pid for name, process in stack.processes.items()}
    driver = Driver("fairserve", Served(stack.url, model), Plan(max_tokens=new_tokens, short_prompts=short))
    worker_port, scheduler_port = stack.ports.workers[0][1], stack.ports.scheduler_metrics
    worker_family, rpc_family = names.WORKER_STEP.name, names.SCHEDULER_WORKER_STEP.name
    try:
        await warm_up(driver)
        before = _scrape(worker_port, worker_family), _scrape(scheduler_port, rpc_family)
        meters = CpuMeter(services).start(), client_meter().start()
        started = time.perf_counter()
        run = await driver.closed(concurrency, unique_requests(concurrency, new_tokens, seed=7, short=short))
        wall = time.perf_counter() - started
        cpu = {**meters[0].finish(), **meters[1].finish()}
        after = _scrape(worker_port, worker_family), _scrape(scheduler_port, rpc_family)
    finally:
        await driver.close()
    tokens = sum(r.completion_tokens for r in run.records)
    return ServedSteps(wall, after[0].count - before[0].count, after[0].total_s - before[0].total_s,
                       after[1].total_s - before[1].total_s, tokens, cpu)


def served_steps(model_dir: Path, concurrency: int, new_tokens: int, short: bool) -> ServedSteps:
    with tempfile.TemporaryDirectory(prefix="step-profile-served-") as logs:
        stack = Stack(ports=StackPorts.free(1), env={"MODEL_NAME": str(model_dir), "LOG_LEVEL": "warning"},
                      log_dir=Path(logs)).start(timeout_s=900)
        try:
            model = str(httpx.get(stack.url + "/v1/models", timeout=10).json()["data"][0]["id"])
            return asyncio.run(_drive(stack, model, concurrency, new_tokens, short))
        finally:
            stack.stop()
