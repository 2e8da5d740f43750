"""Starting and stopping each system under test, one at a time, on free local
ports, and what each needs in a request body so that every system decodes the
same way: greedy, exactly `max_tokens` tokens (the end-of-sequence token does
not stop it).

A system is started as a context manager that yields a `Served` (base URL, the
model name its requests name, and the root process of each of its services, whose
resident memory the sweep samples) and stops it, with its whole process group,
on the way out. Logs go under the run's log directory.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from fairserve.launcher.stack import Stack, StackPorts, free_port

SYSTEMS = ("fairserve", "vllm", "llama.cpp", "transformers")
START_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class Served:
    url: str
    model: str
    services: dict[str, int] = field(default_factory=dict)   # service name -> root pid of its process tree
    settings: str = ""                  # how it was configured, as the report prints it


@dataclass(frozen=True)
class Tuning:
    """One documented configuration of a system: its environment and extra arguments."""
    name: str
    env: dict[str, str] = field(default_factory=dict)
    args: tuple[str, ...] = ()

    def describe(self) -> str:
        return " ".join([*(f"{k}={v}" for k, v in self.env.items()), *self.args]) or "defaults"


@dataclass(frozen=True)
class LaunchConfig:
    model_dir: Path                     # the HF directory (safetensors) of the model
    log_dir: Path
    max_concurrency: int                # the most requests a point keeps in flight
    gguf: Path | None = None            # llama.cpp's model
    vllm: Path | None = None            # the `vllm` command in its own venv
    llama_server: Path | None = None
    tiny: bool = False                  # the tiny test model (a 1024-token context)
    tuning: Tuning | None = None        # None: the system's recommended one (tunings()[0])
    extra_env: dict[str, str] = field(default_factory=dict)   # added to the system's own (e.g. adapters)
    extra_args: tuple[str, ...] = ()
    dtype: str = "float32"              # what the model computes in: float32 or bfloat16 (DTYPES)


# How each system is told to compute in a dtype: fairserve's CPU setting (its weights stay
# exact codes; the GEMMs of wide steps run in bfloat16), the peers' --dtype. llama.cpp runs
# its GGUF's own types whatever is asked.
DTYPES = ("float32", "bfloat16")


def fairserve_dtype_env(dtype: str) -> dict[str, str]:
    return {} if dtype == "float32" else {"CPU_COMPUTE": dtype}


def allowed_cpus() -> list[int]:
    """The CPUs this process may run on (its affinity: a cgroup cpuset or taskset included)."""
    return sorted(os.sched_getaffinity(0))


def cpu_list(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5" (the form VLLM_CPU_OMP_THREADS_BIND and taskset take)."""
    ranges: list[str] = []
    start = previous = None
    for cpu in [*cpus, None]:
        if cpu is not None and previous is not None and cpu == previous + 1:
            previous = cpu
            continue
        if start is not None:
            ranges.append(str(start) if start == previous else f"{start}-{previous}")
        start = previous = cpu
    return ",".join(ranges)


def vllm_tunings(config: "LaunchConfig") -> list[Tuning]:
    """vLLM CPU as its documentation recommends first: OpenMP threads bound to the cores it may
    use (VLLM_CPU_OMP_THREADS_BIND; left to `auto`, a 2-core machine gets one thread, a core
    being reserved for the server) and KV space for every request in flight
    (VLLM_CPU_KVCACHE_SPACE, GiB); then its defaults, for --tune-peers."""
    kv_space = {"VLLM_CPU_KVCACHE_SPACE": "1" if config.tiny else "4"}
    return [Tuning("threads bound to the allowed cores",
                   {"VLLM_CPU_OMP_THREADS_BIND": cpu_list(allowed_cpus()), **kv_space}),
            Tuning("vLLM's default thread binding (auto)", dict(kv_space))]


def llama_tunings(config: "LaunchConfig") -> list[Tuning]:
    """llama-server as its documentation recommends: as many generation and batch threads as
    cores, a slot per request in flight and context for each; then fewer slots, for
    --tune-peers (8 slots queue the rest)."""
    threads = str(len(allowed_cpus()))
    per_slot = 1024 if config.tiny else 2048

    def slots(count: int) -> Tuning:
        return Tuning(f"{count} slots", args=("-t", threads, "-tb", threads, "-np", str(count),
                                              "-c", str(count * per_slot)))

    most = max(config.max_concurrency, 1)
    return [slots(most), *([slots(8)] if most > 8 else [])]


def tunings(system: str, config: "LaunchConfig") -> list[Tuning]:
    """The configurations --tune-peers tries for `system`, the recommended one first."""
    if system == "vllm":
        return vllm_tunings(config)
    if system == "llama.cpp":
        return llama_tunings(config)
    return [Tuning("defaults")]


def greedy_fields(system: str, max_tokens: int) -> dict[str, Any]:
    """Extra body fields for greedy decoding of exactly `max_tokens` tokens on `system`."""
    if system == "transformers":
        # transformers serve has no ignore_eos; a generation config of its own has no
        # eos_token_id, so nothing ends the sequence before max_new_tokens.
        return {"generation_config": json.dumps({"max_new_tokens": max_tokens, "do_sample": False})}
    return {"ignore_eos": True}


def wait_healthy(process: subprocess.Popen, url: str, log: Path, timeout_s: float) -> None:
    """Returns once `url`/health answers 200; raises with the log's tail if the process exits
    first, or after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
            raise RuntimeError(f"exited with {process.returncode} before serving; {log}:\n{tail}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"not healthy after {timeout_s:g} s; see {log}")
        time.sleep(1)


@contextmanager
def _process(name: str, command: list[str], log_dir: Path, port: int, model: str,
             env: dict[str, str] | None = None, service: str | None = None, settings: str = "") -> Iterator[Served]:
    """`command` as one service (named `service`, default `name`): its process tree."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{name}.log"
    with log.open("w") as out:
        out.write(f"$ {' '.join([*(f'{k}={v}' for k, v in (env or {}).items()), *command])}\n")
        out.flush()
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                   env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(process, url, log, START_TIMEOUT_S)
        yield Served(url, model, {service or name: process.pid}, settings)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()


@contextmanager
def fairserve(config: LaunchConfig) -> Iterator[Served]:
    """The whole stack (gateway, scheduler, one worker, kvcache) with its defaults."""
    chosen = {**fairserve_dtype_env(config.dtype), **config.extra_env}
    env = {"MODEL_NAME": str(config.model_dir), "LOG_LEVEL": "warning", **chosen}
    stack = Stack(ports=StackPorts.free(1), env=env, log_dir=config.log_dir / "fairserve").start(
        timeout_s=START_TIMEOUT_S)
    try:
        models = httpx.get(stack.url + "/v1/models", timeout=10).json()["data"]
        yield Served(stack.url, str(models[0]["id"]),
                     {name: process.pid for name, process in stack.processes.items()},
                     " ".join(f"{k}={v}" for k, v in chosen.items()) or "defaults (as make run)")
    finally:
        stack.stop()


@contextmanager
def transformers_serve(config: LaunchConfig) -> Iterator[Served]:
    """`transformers serve --continuous-batching` on CPU, in the run's dtype like the worker."""
    executable = shutil.which("transformers", path=str(Path(sys.executable).parent)) or "transformers"
    port = free_port()
    blocks = 16 if config.tiny else 96           # pages of 256 tokens; on CPU it sizes them from RAM otherwise
    command = [executable, "serve", str(config.model_dir), "--continuous-batching", "--cb-num-blocks",
               str(blocks), "--cb-max-batch-tokens", "2048", "--device", "cpu", "--dtype", config.dtype,
               "--host", "127.0.0.1", "--port", str(port)]
    with _process("transformers", command, config.log_dir, port, str(config.model_dir),
                  service="transformers serve", settings=" ".join(command[2:])) as served:
        yield served


@contextmanager
def vllm_serve(config: LaunchConfig) -> Iterator[Served]:
    """vLLM's CPU build from its own venv, in the run's dtype, room for every request in flight, its
    prefix cache on (its default) and reported in the usage, configured as `vllm_tunings` says."""
    if config.vllm is None:
        raise RuntimeError("vLLM is not set up")
    tuning = config.tuning or vllm_tunings(config)[0]
    port = free_port()
    # The API server module, not the `vllm` command: the command asks for the version of a
    # distribution named `vllm`, and this one is named `vllm-cpu`.
    python = config.vllm.parent / "python"
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(config.model_dir),
               "--served-model-name", "model",
               "--dtype", config.dtype, "--max-model-len", "1024" if config.tiny else "4096",
               "--max-num-seqs", str(max(config.max_concurrency, 1)), "--enable-prompt-tokens-details",
               "--host", "127.0.0.1", "--port", str(port), *tuning.args, *config.extra_args]
    env = {**tuning.env, "VLLM_TARGET_DEVICE": "cpu", **config.extra_env}
    settings = " ".join([*(f"{k}={v}" for k, v in env.items()), f"--dtype {config.dtype}",
                         f"--max-num-seqs {max(config.max_concurrency, 1)}", *tuning.args, *config.extra_args])
    with _process("vllm", command, config.log_dir, port, "model", env, settings=settings) as served:
        yield served


@contextmanager
def llama_server(config: LaunchConfig) -> Iterator[Served]:
    """llama.cpp's server on the default GGUF, configured as `llama_tunings` says."""
    if config.llama_server is None or config.gguf is None:
        raise RuntimeError("llama.cpp is not set up")
    port = free_port()
    tuning = config.tuning or llama_tunings(config)[0]
    command = [str(config.llama_server), "-m", str(config.gguf), "--alias", "model", "--host", "127.0.0.1",
               "--port", str(port), *tuning.args, "--no-webui", *config.extra_args]
    with _process("llama.cpp", command, config.log_dir, port, "model", service="llama-server",
                  settings=" ".join([*tuning.args, *config.extra_args])) as served:
        yield served


LAUNCHERS: dict[str, Callable[[LaunchConfig], Any]] = {
    "fairserve": fairserve, "vllm": vllm_serve, "llama.cpp": llama_server, "transformers": transformers_serve,
}
