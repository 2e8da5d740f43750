"""What the worker plugs into its engine: the device speed-ups of engine/cpu and engine/cuda.

The engine core imports neither (engine/accelerators.py states the contract); here an
`Accelerators` is filled with their functions, and `build_engine` is how the worker, the
engine tests and the benchmarks build an Engine that serves with them.

Which kernel runs a step's prefill chunks' attention (ATTENTION_BACKEND), `load_prefill_kernel`:
`auto` takes flash-attn's varlen call on CUDA in float16/bfloat16 when the package imports
(cuda/varlen_attention.py), the native C kernel on CPU in float32 when it builds and passes its
start-up check (cpu/native_prefill.py), else SDPA per chunk. `sdpa` never uses a fused kernel;
`flash_attn` and `native` require theirs and refuse to start without it.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import torch

from services.worker.engine.accelerators import Accelerators, GraphCapture
from services.worker.engine.config import EngineConfig
from services.worker.engine.cpu import host_memory, library_pages
from services.worker.engine.cpu.cpu_share import IdleClock, WaitClock, default_threads
from services.worker.engine.cpu.thread_governor import GovernorConfig, ThreadGovernor
from services.worker.engine.cpu.thread_pacer import ThreadPacer
from services.worker.engine.cpu.screen.coded_head import serve_tied_weight_from_codes
from services.worker.engine.cpu.kernels.native_build import default_cache_dir
from services.worker.engine.cpu.kernels.native_decode import load_decode_kernel
from services.worker.engine.cpu.kernels.native_prefill import load_native_prefill
from services.worker.engine.cpu.screen.screen_loader import ScreenLoader
from services.worker.engine.cpu.speedups import apply_speedups, runs_direct_forward
from services.worker.engine.cuda.decode_graphs import CudaGraphCapture, DecodeGraphs
from services.worker.engine.cuda.varlen_attention import load_varlen_kernel
from services.worker.engine.device import resolve_device
from services.worker.engine.engine import Engine
from services.worker.engine.step.varlen import VarlenKernel

ATTENTION_BACKENDS = ("auto", "sdpa", "flash_attn", "native")


def load_prefill_kernel(backend: str, device: torch.device, dtype: torch.dtype,
                        cache_dir: Path | None = None) -> VarlenKernel | None:
    """The fused kernel `backend` asks for on this device and dtype, or None for SDPA per chunk.
    Raises ValueError for an unknown backend or a required kernel that cannot run here."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; expected one of {', '.join(ATTENTION_BACKENDS)}")
    if backend == "native" and device.type != "cpu":
        raise ValueError(f"ATTENTION_BACKEND=native needs CPU float32, not {device.type} {dtype}")
    if device.type == "cpu" and backend in ("auto", "native"):
        return load_native_prefill(backend, dtype, cache_dir)
    return load_varlen_kernel(backend, device, dtype)


def device_accelerators() -> Accelerators:
    """Every speed-up of engine/cpu and engine/cuda; each one still decides by its settings,
    device and dtype whether it serves (a CPU engine takes no CUDA graphs, and so on)."""
    return Accelerators(
        keep_freed_host_memory=host_memory.keep_freed_host_memory,
        bound_gemm_caches=host_memory.bound_gemm_caches,
        release_freed_host_memory=host_memory.release_freed_host_memory,
        release_library_pages=library_pages.release_library_pages,
        checkpoint_page_release=host_memory.checkpoint_page_release,
        default_kernel_dir=default_cache_dir,
        apply_speedups=apply_speedups,
        runs_direct_forward=runs_direct_forward,
        serve_tied_weight_from_codes=serve_tied_weight_from_codes,
        lm_head_screen=ScreenLoader,
        prefill_kernel=load_prefill_kernel,
        decode_kernel=load_decode_kernel,
        graph_capture=CudaGraphCapture,
        decode_graphs=DecodeGraphs)


def build_engine(config: EngineConfig, model: torch.nn.Module | None = None,
                 graph_capture: GraphCapture | None = None) -> Engine:
    """An Engine with the device's speed-ups, as the worker serves."""
    return Engine(config, model, graph_capture, device_accelerators())


def with_cpu_threads(config: EngineConfig) -> EngineConfig:
    """TORCH_THREADS=0 on CPU: the CPUs the worker may run on, no more than its cgroup quota's
    whole CPUs (torch's own default counts the machine's cores, over a Kubernetes CPU limit)."""
    if config.torch_threads > 0 or resolve_device(config.device).type != "cpu":
        return config
    return dataclasses.replace(config, torch_threads=default_threads())


def thread_pacer(policy: str, engine: Engine) -> ThreadPacer | None:
    """CPU_THREAD_POLICY=adaptive on CPU with more than one thread and the kernel's per-thread
    scheduler statistics: the pacer of the engine's thread count (call on the engine's thread,
    which it starts at the full count). None otherwise."""
    clock = WaitClock()
    threads = torch.get_num_threads()
    if policy != "adaptive" or engine.device.type != "cpu" or threads < 2 or not clock.available():
        return None
    idle = IdleClock()
    pacer = ThreadPacer(ThreadGovernor(GovernorConfig(max_threads=threads), time.monotonic()), clock,
                        idle=idle if idle.available() else None)
    pacer.start()
    return pacer
