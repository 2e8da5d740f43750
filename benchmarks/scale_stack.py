"""The processes of one scale-benchmark row: the real kvcache index and scheduler (or
`shards` schedulers, each with its own pool of workers and the others as SCHEDULER_PEERS),
and the simulated workers (sim_workers.py, a process per shard), on free local ports; the
schedulers' CPU and steps read between two marks; the workers' step gaps read back when
they stop."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.cpu_time import process_cpu_seconds
from benchmarks.sim_engine import StepCosts
from services.scheduler.lookup_records import LookupRecords

LOOKUP_RECORDS_S = LookupRecords.interval_s + 0.2   # a recorded lookup's longest way to the index


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class StackConfig:
    workers: int
    costs: StepCosts
    tokens: bool = False     # INTERNAL_TOKEN and WORKER_TOKEN on every process
    max_batch: int = 64
    profile: str | None = None   # write the scheduler's cProfile stats here
    log_dir: str | None = None   # keep the processes' logs here (default: a temporary folder)
    log_level: str = "warning"
    shards: int = 1              # schedulers, the workers split evenly between them
    exchange: bool = True        # shards exchange their tenants' service (SCHEDULER_PEERS)
    decode_steps: int = 16       # the schedulers' DECODE_STEPS
    prefill_decode_steps: int = 1   # their PREFILL_DECODE_STEPS
    max_batch_tokens: int = 2048    # their MAX_BATCH_TOKENS


class Stack:
    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self._dir = tempfile.TemporaryDirectory(prefix="scale-bench-")
        self.env = {**os.environ, "LOG_LEVEL": config.log_level}
        if config.tokens:
            self.env.update(INTERNAL_TOKEN=secrets.token_hex(16), WORKER_TOKEN=secrets.token_hex(16))
        kv_port, self.ports = free_port(), [free_port() for _ in range(config.shards)]
        self.port = self.ports[0]
        self.kv_port = kv_port
        self.env.update(KVCACHE_PORT=str(kv_port), KVCACHE_METRICS_PORT="0", KVCACHE_ADDR=f"127.0.0.1:{kv_port}",
                        SCHEDULER_METRICS_PORT="0",
                        MAX_BATCH_SIZE=str(config.max_batch), MAX_BATCH_TOKENS=str(config.max_batch_tokens),
                        MAX_ACTIVE_KV_TOKENS=str(1 << 30),
                        MAX_QUEUE_LEN=str(1 << 20), QUEUE_TIMEOUT_S="600", SPECULATIVE_TOKENS="0",
                        DECODE_STEPS=str(config.decode_steps),
                        PREFILL_DECODE_STEPS=str(config.prefill_decode_steps),
                        # the simulated workers share two busy cores: a late heartbeat is not a dead worker
                        WORKER_HEARTBEAT_TIMEOUT_S="60")
        self._stats_paths = [Path(self._dir.name) / f"workers-{shard}.json" for shard in range(config.shards)]
        self.log_dir = config.log_dir or self._dir.name
        self.processes: list[subprocess.Popen] = []
        self._mark = (0.0, 0)
        self.scheduler_cpu_by_shard: list[float] = []
        self._cpu_mark: list[float] = []
        self.window = [0.0, 0.0]
        self.steps_in_window = 0
        self.scheduler_cpu_in_window = 0.0
        self.index_in_window: dict[str, int] = {}   # the kvcache index's counters over the window
        self._index_mark: dict[str, int] = {}
        self._channels: dict[tuple[int, int], object] = {}

    def _start(self, *module: str, **env: str) -> subprocess.Popen:
        """A process whose log goes to a file of its own (a pipe nobody reads would stall it)."""
        name = next(part for part in module if part.startswith(("services.", "benchmarks."))).split(".")[1]
        log = (Path(self.log_dir) / f"{len(self.processes)}-{name}.log").open("w")
        process = subprocess.Popen([sys.executable, "-m", *module], env={**self.env, **env},
                                   stdout=subprocess.DEVNULL, stderr=log, text=True)
        log.close()
        self.processes.append(process)
        return process

    def log_tail(self, process: subprocess.Popen, chars: int = 2000) -> str:
        index = self.processes.index(process)
        return "".join(path.read_text()[-chars:] for path in Path(self.log_dir).glob(f"{index}-*.log"))

    def __enter__(self) -> Stack:
        self._start("services.kvcache.main")
        profile = ("cProfile", "-o", self.config.profile, "-m") if self.config.profile else ()
        self.schedulers = []
        for shard, port in enumerate(self.ports):
            peers = ",".join(f"127.0.0.1:{other}" for other in self.ports if other != port)
            self.schedulers.append(self._start(*(profile if shard == 0 else ()), "services.scheduler.main",
                                               SCHEDULER_PORT=str(port),
                                               SCHEDULER_PEERS=peers if self.config.exchange else ""))
        self.scheduler = self.schedulers[0]
        costs = self.config.costs
        costs_path = Path(self._dir.name) / "costs.json"
        costs_path.write_text(json.dumps(costs.__dict__))
        self.sims = [self._start("benchmarks.sim_workers", "--count", str(self.workers_of(shard)),
                                 "--scheduler", f"127.0.0.1:{port}", "--costs", str(costs_path),
                                 "--stats-out", str(self._stats_paths[shard]), "--name", f"s{shard}-w")
                     for shard, port in enumerate(self.ports)]
        return self

    def workers_of(self, shard: int) -> int:
        """The workers registered with `shard` (the first shards take one more when uneven)."""
        count, extra = divmod(self.config.workers, self.config.shards)
        return count + (1 if shard < extra else 0)

    def scheduler_stub(self, channel: int = 0, shard: int = 0):
        """A stub on the load's `channel`-th connection to `shard` (streams spread over a few connections)."""
        import grpc
        from fairserve.v1 import scheduler_pb2_grpc
        from common.transport.grpc_server import CHANNEL_OPTIONS
        from common.transport.internal_auth import InternalAuth
        from common.transport.internal_auth import token_interceptors
        if (shard, channel) not in self._channels:   # a connection each (plaintext: the benchmark sets no TLS)
            self._channels[shard, channel] = grpc.aio.insecure_channel(
                f"127.0.0.1:{self.ports[shard]}", options=[*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)],
                interceptors=token_interceptors(InternalAuth.from_env(self.env).token))
        return scheduler_pb2_grpc.SchedulerStub(self._channels[shard, channel])

    async def close_channels(self) -> None:
        """Before the load's event loop ends (grpc's poller would call into a closed loop)."""
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()

    async def _stats(self, shard: int = 0):
        from fairserve.v1 import common_pb2
        return await self.scheduler_stub(shard=shard).Stats(common_pb2.StatsRequest(), timeout=60)

    async def wait_registered(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for process in self.processes:
                if process.poll() is not None:
                    raise RuntimeError(f"a benchmark process exited: {process.args}: {self.log_tail(process)}")
            try:
                registered = [len((await self._stats(shard)).workers) for shard in range(self.config.shards)]
                if all(count >= self.workers_of(shard) for shard, count in enumerate(registered)):
                    return
            except Exception:   # noqa: BLE001  (not serving yet)
                pass
            await asyncio.sleep(0.2)
        raise TimeoutError(f"{self.config.workers} simulated workers did not register in {timeout_s} s")

    def _cpu(self) -> list[float]:
        return [process_cpu_seconds(scheduler.pid) for scheduler in self.schedulers]

    async def mark(self) -> None:
        """The window's start: the schedulers' CPU, their workers' steps and the index's counters so far."""
        self.window = [time.monotonic(), 0.0]
        self._cpu_mark = self._cpu()
        self._mark = (sum(self._cpu_mark), await self._steps())
        self._index_mark = await self._index_counters()

    async def mark_end(self) -> None:
        self.window[1] = time.monotonic()
        cpu, steps = self._cpu(), await self._steps()
        self.scheduler_cpu_by_shard = [now - before for now, before in zip(cpu, self._cpu_mark)]
        self.scheduler_cpu_in_window = sum(cpu) - self._mark[0]
        self.steps_in_window = steps - self._mark[1]
        # With one worker a shard records its requests' lookups every half second
        # (services/scheduler/lookup_records.py): the window's last ones reach the index after it.
        await asyncio.sleep(LOOKUP_RECORDS_S)
        index = await self._index_counters()
        self.index_in_window = {name: value - self._index_mark.get(name, 0) for name, value in index.items()}
        self.index_in_window["blocks"] = index["blocks"]     # indexed at the window's end, not a delta

    async def _index_counters(self) -> dict[str, int]:
        """The kvcache index's lookups and the blocks it holds (the workers' published caches)."""
        from common.transport.internal_auth import InternalAuth
        from services.kvcache.client import KvIndexClient
        client = KvIndexClient.connect(f"127.0.0.1:{self.kv_port}", 10.0, InternalAuth.from_env(self.env))
        try:
            stats = await client.stats()
        finally:
            await client.close()
        return {"lookup_tokens": stats.lookup_tokens, "hit_tokens": stats.hit_tokens,
                "blocks": sum(stats.blocks_by_worker.values())}

    async def _steps(self) -> int:
        steps = 0
        for shard in range(self.config.shards):
            steps += sum(worker.steps for worker in (await self._stats(shard)).workers)
        return steps

    def worker_steps(self) -> tuple[list[float], float]:
        """Once the simulated workers have stopped: the idle gaps (ms) before the steps that
        started in the window, and the fraction of the window their devices were busy."""
        for sim in self.sims:
            sim.send_signal(signal.SIGTERM)
        for sim in self.sims:
            sim.wait(timeout=30)
        start, end = self.window
        steps = [step for path in self._stats_paths for step in json.loads(path.read_text())["steps"]
                 if start <= step[0] < end]
        busy = sum(duration for _, _, duration in steps) / (self.config.workers * (end - start))
        return [gap * 1000.0 for _, gap, _ in steps], busy

    def __exit__(self, *exc: object) -> None:
        for process in reversed(self.processes):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
        self._dir.cleanup()
