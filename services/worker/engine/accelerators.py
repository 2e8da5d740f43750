"""The device speed-ups an engine can be handed, and what the core does without them.

The engine core (every module of this package outside cpu/ and cuda/) imports nothing from
cpu/ or cuda/: their speed-ups are plugged in from outside, as the plain callables of an
`Accelerators`, which the worker's wiring (services/worker/wiring.py) fills and hands to
`Engine`. An engine built without one (`Accelerators()`) runs transformers' forward with
SDPA attention, the full LM head and eager decodes, on any device.

The contract, for whoever fills one:
- Every field is optional; its default is the core's own path (no speed-up, no validation
  of the speed-up's settings beyond refusing a required kernel it cannot give).
- The callables run while the model is prepared (`prepare_model`, `Engine.__init__`), once per
  engine, on the thread that builds it; never per step. Per step only the objects they return
  are called, through the protocols below (and attention.DecodeKernel, varlen.VarlenKernel).
- A speed-up serves the same tokens as the core path: exact, or within the tolerance its own
  module documents and checks; one that cannot serve here returns None (or leaves the model as
  it was) rather than raising, unless its setting requires it.
- `apply_speedups` may replace modules of the model in place, and returns what it did as a
  `Speedups` (or a subclass that reports more).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from services.worker.engine.step.attention import DecodeKernel, StepMetadata
from services.worker.engine.config import EngineConfig
from services.worker.engine.lora.layers import LoraStep
from services.worker.engine.step.varlen import VarlenKernel

# hidden states of the packed rows: (input_ids [T], positions [T], metadata) -> [T, hidden]
BaseForward = Callable[[torch.Tensor, torch.Tensor, StepMetadata], torch.Tensor]


class DirectForward(Protocol):
    """The base model's forward without transformers' module dispatch (cpu/direct_forward.py)."""

    native_rope: bool
    native_layers: object | None        # one-call C decode layers, when they serve

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: StepMetadata) -> torch.Tensor:
        ...

    def serve_loras(self, step: LoraStep) -> None:
        """Re-reads the projections once LoRA wrapped them."""
        ...


class LinearKernelPlan(Protocol):
    kernel: str                         # the packed linears' kernel, e.g. mkl or onednn


@dataclass
class Speedups:
    """What the speed-ups did to a model, as far as the core reads it."""
    lm_head: torch.nn.Module            # the LM head the engine calls (packed when the layers are)
    native_kernels: bool = False        # the C kernels of CPU_NATIVE_KERNELS may serve
    fused_norms: int = 0
    fused_mlps: int = 0
    linear_kernel: LinearKernelPlan | None = None
    native_linears: int = 0             # packed linears whose few-row steps run the C kernel
    coded_linears: int = 0              # packed linears whose few-row steps run from 8-bit codes
    prefill_linear_kernel: str | None = None   # the coded linears' packs, when they differ from the plan's
    direct: DirectForward | None = None


class HeadScreen(Protocol):
    """An LM head screen: a row's logits exact where a draw reading its `count` best tokens (or
    a token its sampler adjusts) can land, -inf elsewhere (cpu/lm_head_screen.py)."""

    MAX_TOP_K: int                      # rows reading more best tokens take the full head
    MAX_ADJUSTED_TOKENS: int            # rows whose sampler adjusts more tokens take the full head

    @property
    def vocab_size(self) -> int:
        ...

    def logits(self, hidden: torch.Tensor, top_counts: list[int], adjusted: list[list[int]]) -> torch.Tensor | None:
        """Float32 [rows, vocab], or None when the screen cannot serve these rows."""
        ...


class HeadScreenLoader(Protocol):
    """When the screen is built and which steps it serves (cpu/screen_loader.py)."""

    screen: HeadScreen | None

    def start(self, head: torch.nn.Module, device: torch.device, dtype: torch.dtype,
              weight: torch.Tensor | None = None, coded: object | None = None) -> None:
        ...

    def wait(self, timeout: float | None = None) -> bool:
        ...

    def screen_for(self, rows: int) -> HeadScreen | None:
        ...

    def max_rows(self, screen: HeadScreen) -> int:
        ...


class NoHeadScreen:
    """The core's LM head: the full head serves every row."""

    screen: HeadScreen | None = None

    def start(self, head: torch.nn.Module, device: torch.device, dtype: torch.dtype,
              weight: torch.Tensor | None = None, coded: object | None = None) -> None:
        return None

    def wait(self, timeout: float | None = None) -> bool:
        return True

    def screen_for(self, rows: int) -> HeadScreen | None:
        return None

    def max_rows(self, screen: HeadScreen) -> int:
        return 0


class GraphCapture(Protocol):
    def capture(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        """Records `fn` (which reads and writes only tensors that outlive it) and returns
        a callable that replays it and returns the tensor `fn` returned."""
        ...


@dataclass(frozen=True)
class GroupRows:
    """The slots and block tables of a decode-only step's rows in the sliding group's blocks."""
    slots: list[int]
    block_tables: list[list[int]]


@dataclass(frozen=True)
class DecodeRows:
    """A decode-only step's rows as plain values, one entry per sequence."""
    token_ids: list[int]
    positions: list[int]
    slots: list[int]
    ctx_lens: list[int]          # context length including the decoded token
    block_tables: list[list[int]]
    sliding: GroupRows | None = None   # under the hybrid layout (sliding_blocks.py)


class DecodeReplays(Protocol):
    """Captured decode forwards (cuda/decode_graphs.py)."""

    replays: int

    def run(self, rows: DecodeRows) -> torch.Tensor | None:
        """The hidden states of `rows` from a replayed graph, or None: the step runs eagerly."""
        ...


# (forward, kv, cache_layer, capture, *, block_size, scratch_block, max_batch, max_context, device,
#  sliding_scratch_block, sliding_window) -> DecodeReplays (cuda/decode_graphs.py: DecodeGraphs)
DecodeGraphsFactory = Callable[..., DecodeReplays]


def _nothing() -> None:
    return None


def _no_gemm_cache_bound(entries: int) -> None:
    return None


class CheckpointPages(Protocol):
    """The checkpoint's file mappings once loaded (cpu/host_memory.py): called with (address,
    bytes), lets those mapped pages go; `holds`: whether a tensor is still a view of them;
    `release`: lets a view's pages go (read again, they come back from the file)."""

    def __call__(self, address: int, nbytes: int) -> object: ...

    def holds(self, tensor: torch.Tensor) -> bool: ...

    def release(self, tensor: torch.Tensor) -> object: ...


class _NoCheckpointPages:
    def __call__(self, address: int, nbytes: int) -> object:
        return 0

    def holds(self, tensor: torch.Tensor) -> bool:
        return False

    def release(self, tensor: torch.Tensor) -> object:
        return 0


def _no_page_release() -> CheckpointPages:
    return _NoCheckpointPages()


def _no_kernel_dir() -> Path | None:
    return None


def _no_speedups(base: torch.nn.Module, lm_head: torch.nn.Module, config: EngineConfig, device: torch.device,
                 dtype: torch.dtype, kernel_cache_dir: Path | None,
                 after_read: Callable[[torch.Tensor], object] | None = None) -> Speedups:
    return Speedups(lm_head=lm_head)


def _no_direct_forward(config: EngineConfig, device: torch.device) -> bool:
    return False


def _no_tied_codes(model: torch.nn.Module, lm_head: torch.nn.Module) -> torch.Tensor | None:
    return None


def _no_screen(config: EngineConfig, softcap: float | None, kernel_cache_dir: Path | None,
               native_kernels: bool) -> HeadScreenLoader:
    return NoHeadScreen()


def _no_prefill_kernel(backend: str, device: torch.device, dtype: torch.dtype,
                       cache_dir: Path | None) -> VarlenKernel | None:
    if backend in ("flash_attn", "native"):
        raise ValueError(f"ATTENTION_BACKEND={backend} needs the device speed-ups, which this engine "
                         "was built without")
    return None


def _no_decode_kernel(backend: str, device: torch.device, dtype: torch.dtype, block_size: int,
                      cache_dir: Path | None) -> DecodeKernel | None:
    if backend == "native":
        raise ValueError("DECODE_ATTENTION=native needs the device speed-ups, which this engine was built without")
    return None


@dataclass(frozen=True)
class Accelerators:
    """The speed-ups an engine is built with; each default is the core's own path."""
    # CPU host memory: tune the allocator once the model is prepared, cap the GEMM caches, hand freed
    # pages back, let the shared libraries' start-up pages go (cpu/library_pages.py).
    keep_freed_host_memory: Callable[[], object] = _nothing
    bound_gemm_caches: Callable[[int], object] = _no_gemm_cache_bound
    release_freed_host_memory: Callable[[], object] = _nothing
    release_library_pages: Callable[[], object] = _nothing
    # After loading: the checkpoint's mappings, whose pages of a weight read or copied go at once.
    checkpoint_page_release: Callable[[], CheckpointPages] = _no_page_release
    # Where compiled kernels are kept when KERNEL_CACHE_DIR is unset.
    default_kernel_dir: Callable[[], Path | None] = _no_kernel_dir
    # (base, lm_head, config, device, dtype, kernel_cache_dir, after_read) -> what was applied to the
    # model; after_read(weight) once a weight has been read to replace it (its mapped pages may go).
    apply_speedups: Callable[..., Speedups] = _no_speedups
    # (config, device) -> whether apply_speedups gives the base model a direct forward (then a
    # model class of our own may stand in for transformers' one: models/loader.py).
    runs_direct_forward: Callable[[EngineConfig, torch.device], bool] = _no_direct_forward
    # (model, lm_head) -> the float32 head weight the tied embedding and head no longer hold, or None.
    serve_tied_weight_from_codes: Callable[[torch.nn.Module, torch.nn.Module], torch.Tensor | None] = _no_tied_codes
    # (config, softcap, kernel_cache_dir, native_kernels) -> the LM head screen's loader.
    lm_head_screen: Callable[..., HeadScreenLoader] = _no_screen
    # (ATTENTION_BACKEND, device, dtype, kernel_cache_dir) -> the prefill chunks' fused kernel, or None.
    prefill_kernel: Callable[..., VarlenKernel | None] = _no_prefill_kernel
    # (DECODE_ATTENTION, device, dtype, block_size, kernel_cache_dir) -> the decodes' kernel, or None.
    decode_kernel: Callable[..., DecodeKernel | None] = _no_decode_kernel
    # USE_CUDA_GRAPHS on CUDA: the capture to use, and what replays decode steps from graphs.
    graph_capture: Callable[[], GraphCapture] | None = None
    decode_graphs: DecodeGraphsFactory | None = None
