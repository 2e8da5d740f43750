"""The CPU speed-ups applied to a loaded model, in order, and what each one took.

RMSNorms fused (every device; as a C kernel in float32 on CPU), gated MLPs fused,
linear weights pre-packed (cpu_linear.py), few-row steps routed to the C linear
and, where weights are exact 8-bit codes, to the coded linear (weight_codes.py),
then the direct forward (direct_forward.py) with its one-call C decode layers
(native_layers.py). Each is optional and switched by its setting; what is not
applied leaves transformers' modules as they were. CPU_COMPUTE=bfloat16 (opt-in, lossy)
gives the layers' linears bfloat16 packs for their wide steps (bf16_compute.py).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from services.worker.engine.accelerators import Speedups
from services.worker.engine.config import EngineConfig, require_choice
from services.worker.engine.cpu.linear import weight_codes
from services.worker.engine.cpu.linear.bf16_compute import (CPU_COMPUTE_MODES, Bfloat16Compute, apply_bfloat16,
                                                     bfloat16_pays, require_bfloat16_cpu)
from services.worker.engine.cpu.linear.coded_wide import PREFILL_WEIGHTS_MODES, WideFromCodes
from services.worker.engine.cpu.linear.prefill_gemm import MODES as PREFILL_GEMM_MODES
from services.worker.engine.cpu.linear.prefill_gemm import load_prefill_gemm
from services.worker.engine.cpu.linear.amx_gemm import load_amx_gemm
from services.worker.engine.cpu.linear.cpu_linear import (ALL_ROWS, PREFILL_CODES_TOLERANCE, PREFILL_PACK_ROWS_HINT,
                                                   KernelPlan, PackedLinear, choose_prefill_kernel, kernel_available,
                                                   pack_linears, resolve_kernel_plan)
from services.worker.engine.cpu.direct_forward import DirectForward
from services.worker.engine.cpu.linear.fused_mlp import fuse_gated_mlps
from services.worker.engine.cpu.linear.fused_norms import fuse_rms_norms
from services.worker.engine.cpu.kernels.native_layers import NativeDecodeLayers
from services.worker.engine.cpu.kernels.native_ops import NativeElementwise, load_elementwise, load_skinny_linear
from services.worker.engine.cpu.linear.narrow_calibration import time_widths
from services.worker.engine.cpu.linear.weight_codes import NativeCodedLinear, load_coded_linear

CPU_NATIVE_KERNELS_MODES = ("auto", "off")
DIRECT_FORWARD_MODES = ("auto", "off")
CPU_WEIGHT_CODES_MODES = ("auto", "narrow", "8bit", "off")   # auto: narrow where it measures faster
# Rows per step up to which linear layers use the C kernel: past 8 the packed BLAS kernels
# were faster on the AMD EPYC (the C kernel holds up to 8 rows in registers per weight pass).
SKINNY_MAX_ROWS = 8

log = logging.getLogger(__name__)


@dataclass
class CpuSpeedups(Speedups):
    """What the core reads (accelerators.Speedups: the LM head, the linears' plan, the direct
    forward, counts), and what only the CPU's own paths and their tests read."""
    bfloat16: Bfloat16Compute | None = None    # CPU_COMPUTE=bfloat16: the layers' wide GEMMs
    dropped_bytes: int = 0                 # weight copies the coded linears made unneeded: let go, or packs never built
    prefill_weights: str = "packs"         # what the coded layers' wide steps multiply: packs or codes
    native_prefill_shapes: int = 0         # weight shapes whose wide steps the native GEMM serves
    amx_prefill_shapes: int = 0            # ... the AMX GEMM serves


@dataclass(frozen=True)
class _Target:
    config: EngineConfig
    device: torch.device
    dtype: torch.dtype
    kernel_cache_dir: Path


def apply_speedups(base: torch.nn.Module, lm_head: torch.nn.Module, config: EngineConfig, device: torch.device,
                   dtype: torch.dtype, kernel_cache_dir: Path,
                   after_read: Callable[[torch.Tensor], object] | None = None) -> CpuSpeedups:
    """Applies the speed-ups that `config` allows on `device` to `base` (modules swapped in
    place) and returns what was applied, with the LM head the engine calls. `after_read` is
    called with each weight matrix (or a chunk of it) once a speed-up has read it: the loader
    lets the checkpoint's mapped pages of it go (model.py)."""
    after_read = after_read or _keep_pages
    target = _Target(config, device, dtype, kernel_cache_dir)
    _check_compute(target)
    declined = config.cpu_compute == "bfloat16" and not bfloat16_pays(base)
    if declined:    # everything below as for float32 (bf16_compute.py)
        config = dataclasses.replace(config, cpu_compute="float32")
        target = _Target(config, device, dtype, kernel_cache_dir)
    require_choice("CPU_PREFILL_WEIGHTS", config.cpu_prefill_weights, PREFILL_WEIGHTS_MODES)
    require_choice("CPU_PREFILL_GEMM", config.cpu_prefill_gemm, PREFILL_GEMM_MODES)
    done = CpuSpeedups(lm_head=lm_head, native_kernels=_native_kernels_enabled(target))
    native_ops = load_elementwise(kernel_cache_dir) if done.native_kernels else None
    done.fused_norms = fuse_rms_norms(base, native_ops)
    done.fused_mlps = fuse_gated_mlps(base, native_ops) if native_ops is not None else 0
    _after_reading(after_read, base, lm_head)      # the fused MLPs' probes read their weights
    done.linear_kernel = _packed_kernel_plan(target)
    if done.linear_kernel is not None:
        # The packs wait until the weight codes are known (`_pack_where_served`).
        pack_linears(base, {dtype: done.linear_kernel}, pack=False)
        if isinstance(lm_head, torch.nn.Linear):
            done.lm_head = PackedLinear(lm_head, done.linear_kernel.lm_head_max_rows, done.linear_kernel.kernel,
                                        pack=False)
    done.native_linears = _route_few_rows_to_native(target, base, done.lm_head) if done.native_kernels else 0
    done.coded_linears = _route_few_rows_to_codes(target, base, done, after_read)
    if config.cpu_compute == "bfloat16":
        _pack_where_served(base, done.lm_head, None)   # its calibration times the layers' float32 packs
    done.bfloat16 = (Bfloat16Compute(linears=0, min_rows=None) if declined
                     else apply_bfloat16(base) if config.cpu_compute == "bfloat16" else None)
    done.direct = _direct_forward(target, base, native_ops, done.coded_linears)
    wide = _wide_from_codes(target, base, done.lm_head)
    done.prefill_weights = "codes" if wide is not None else "packs"
    done.native_prefill_shapes = wide.native_shapes() if wide is not None else 0
    done.amx_prefill_shapes = wide.amx_shapes() if wide is not None else 0
    unbuilt = _pack_where_served(base, done.lm_head, wide)
    done.dropped_bytes = unbuilt + _drop_unserved_copies(base, done.lm_head, wide)
    _after_reading(after_read, base, done.lm_head)     # the packs' and calibrations' reads
    return done


def _keep_pages(weight: torch.Tensor) -> None:
    return None


def _after_reading(after_read: Callable[[torch.Tensor], object], *modules: torch.nn.Module) -> None:
    """`after_read` on every weight matrix `modules` hold (whatever the speed-ups read so far)."""
    seen: set[int] = set()
    for module in modules:
        for weight in module.parameters():
            if weight.dim() == 2 and id(weight) not in seen:
                seen.add(id(weight))
                after_read(weight.detach())


def _pack_where_served(base: torch.nn.Module, lm_head: torch.nn.Module, wide: WideFromCodes | None) -> int:
    """Builds the deferred packs that some step will multiply: not the coded LM head's (its codes
    and their tiles serve every row) nor those of the coded layers whose wide steps `wide`
    expands from their codes. Packing every linear first and dropping these afterwards held
    them all at once beside the float32 weights: the default model's worker peaked at 3.1 GB
    while it started, to hold ~0.85 GB once ready (the LM head's pack alone 640 MB). Returns the
    bytes of the packs not built (a float32 pack holds about its weight's bytes)."""
    unbuilt = 0
    for linear in _packed_linears(base, lm_head):
        if linear.coded is None or (linear is not lm_head and wide is None):
            linear.pack_now()
        elif linear.deferred_rows_hint is not None and linear.weight is not None:
            unbuilt += _nbytes(linear.weight)
    return unbuilt


def _wide_from_codes(target: _Target, base: torch.nn.Module, lm_head: torch.nn.Module) -> WideFromCodes | None:
    """What the coded layers' wide steps multiply (CPU_PREFILL_WEIGHTS): their float32 packs
    (None), or the weight expanded from their codes. `auto` takes the codes where every
    coded layer's pack is oneDNN's and a pack written from its codes stands in for it
    (coded_wide.py): the same kernel on the same bytes, without the pack's ~380 MB. From the
    codes, the native GEMM (CPU_PREFILL_GEMM, prefill_gemm.py) may serve a shape instead."""
    config = target.config
    layers = [linear for linear in _packed_linears(base, lm_head) if linear is not lm_head and linear.coded is not None]
    mode = config.cpu_prefill_weights
    if mode == "packs" or not layers or (mode == "auto" and config.cpu_compute != "float32"):
        if mode == "codes":
            log.warning("CPU_PREFILL_WEIGHTS=codes: no layer runs from weight codes here (CPU_WEIGHT_CODES, "
                        "a checkpoint whose weights are not exact codes, or not float32 on CPU): nothing changes")
        return None
    onednn = kernel_available("onednn", torch.float32)
    gemm = load_prefill_gemm(target.kernel_cache_dir) if config.cpu_prefill_gemm != "library" else None
    amx = load_amx_gemm(target.kernel_cache_dir) if config.cpu_prefill_gemm in ("auto", "amx") else None
    if config.cpu_prefill_gemm == "amx" and amx is None:
        log.warning("CPU_PREFILL_GEMM=amx: the AMX GEMM does not run here (no AMX-BF16, or the tiles not "
                    "granted): the other GEMMs serve prefill")
    wide = WideFromCodes(layers[0].coded_kernel, onednn, PREFILL_PACK_ROWS_HINT, gemm, config.cpu_prefill_gemm, amx)
    same_kernel = all(linear.kernel == "onednn" and linear.max_packed_rows == ALL_ROWS for linear in layers)
    blocked = all([wide.prepare(linear.coded) for linear in layers]) if onednn else False
    if mode == "auto" and not (same_kernel and blocked) and not _amx_serves_all(wide, layers):
        log.info("prefill: the layers' float32 packs serve wide steps (%s)",
                 "no pack written from codes stands in for oneDNN's here" if same_kernel
                 else "oneDNN does not pack these layers' prefill here")
        return None
    for linear in layers:
        wide.prepare_gemm(linear.coded)
    wide.settle_amx()
    log.info("prefill: the layers' wide steps multiply their weights expanded from the codes (%s; %d shapes "
             "through the native GEMM, %d through the AMX GEMM)", f"into oneDNN's pack layout, "
             f"{wide.blocked_shapes()} shapes" if blocked else "plain weights", wide.native_shapes(), wide.amx_shapes())
    return wide


def _amx_serves_all(wide: WideFromCodes, layers: list[PackedLinear]) -> bool:
    """Whether the AMX GEMM serves every coded layer's wide steps, each shape decided against
    its layers' float32 packs (what serves them otherwise): then no pack is needed."""
    if wide.amx is None:
        return False
    for linear in layers:
        wide.prepare_amx(linear.coded, _packed_product(linear))
    return wide.settle_amx()


def _packed_product(linear: PackedLinear) -> Callable[[torch.Tensor], torch.Tensor]:
    """`linear`'s wide steps as its float32 pack runs them, the pack built at the first call (one
    linear a shape is timed; the packs go once the AMX GEMM serves them all)."""
    def product(rows: torch.Tensor) -> torch.Tensor:
        linear.pack_now()
        return linear(rows)
    return product


def _drop_unserved_copies(base: torch.nn.Module, lm_head: torch.nn.Module, wide: WideFromCodes | None) -> int:
    """Coded linears keep one copy of their weight beside the codes: the layers their
    prefill pack, the LM head its float32 weight (shared with the tied embedding and
    the screen); with `wide` (CPU_PREFILL_WEIGHTS, coded_wide.py) the layers keep none,
    their wide steps expanding the codes. Returns the bytes let go."""
    dropped = 0
    for linear in _packed_linears(base, lm_head):
        weight, packed = linear.weight, linear.packed
        if linear is lm_head:
            if linear.drop_pack() and packed is not None:
                dropped += _nbytes(packed)
        elif wide is not None and linear.coded is not None:
            linear.serve_wide_rows_from_codes(wide)
            dropped += sum(_nbytes(t) for t in (weight, packed) if t is not None)
        elif linear.drop_float32_weight():
            dropped += _nbytes(weight)
            if packed is not None and linear.packed is None:    # CPU_COMPUTE=bfloat16 serves wide steps
                dropped += _nbytes(packed)
    if dropped:
        log.info("coded linears: %.0f MB of weight copies no path reads dropped", dropped / 1e6)
    return dropped


def _nbytes(tensor: torch.Tensor) -> int:
    """A tensor's bytes, an opaque oneDNN pack's included."""
    if tensor.is_mkldnn:
        return int(torch.ops.mkldnn._nbytes(tensor))
    return tensor.numel() * tensor.element_size()


def _check_compute(target: _Target) -> None:
    """CPU_COMPUTE: bfloat16 only for a float32 model on a CPU with BF16 instructions."""
    require_choice("CPU_COMPUTE", target.config.cpu_compute, CPU_COMPUTE_MODES)
    if target.config.cpu_compute == "float32":
        return
    if target.device.type != "cpu" or target.dtype != torch.float32:
        raise ValueError(f"CPU_COMPUTE=bfloat16 applies to a float32 model on CPU, not {target.dtype} on "
                         f"{target.device.type}: unset CPU_COMPUTE (DTYPE sets the whole model's dtype)")
    require_bfloat16_cpu()


def _native_kernels_enabled(target: _Target) -> bool:
    """Whether the C kernels of CPU_NATIVE_KERNELS (norms, gated activations, few-row
    linears, the screen's int8 kernel) may serve: `auto` on CPU in float32."""
    mode = target.config.cpu_native_kernels
    require_choice("CPU native kernels mode", mode, CPU_NATIVE_KERNELS_MODES)
    return mode == "auto" and target.device.type == "cpu" and target.dtype == torch.float32


def _packed_kernel_plan(target: _Target) -> KernelPlan | None:
    """Pre-packed weights on CPU (cpu_linear.py: MKL or oneDNN for float32, whichever
    is faster on this CPU, oneDNN for bfloat16): decode batches of a few rows then
    cost about what one row does. None: plain linears."""
    if not target.config.cpu_packed_weights or target.device.type != "cpu":
        return None
    return resolve_kernel_plan(target.config.cpu_linear_kernel, target.dtype)


def _packed_linears(base: torch.nn.Module, lm_head: torch.nn.Module) -> list[PackedLinear]:
    return [m for m in (*base.modules(), lm_head) if isinstance(m, PackedLinear)]


def _route_few_rows_to_native(target: _Target, base: torch.nn.Module, lm_head: torch.nn.Module) -> int:
    """Packed linears (layers and LM head) run steps of at most SKINNY_MAX_ROWS rows
    through the C kernel; returns how many."""
    kernel = load_skinny_linear(target.kernel_cache_dir)
    if kernel is None:
        return 0
    return sum(1 for linear in _packed_linears(base, lm_head) if linear.use_native(kernel, SKINNY_MAX_ROWS))


def _route_few_rows_to_codes(target: _Target, base: torch.nn.Module, done: CpuSpeedups,
                             after_read: Callable[[torch.Tensor], object] = _keep_pages) -> int:
    """Packed linears whose float32 weights are exact 8-bit codes (weight_codes.py) run
    steps of at most weight_codes.MAX_ROWS rows through the coded kernel, with `auto` from
    their codes in the fewest bits (4-6) that hold them where that is faster (`_narrow_codes`);
    returns how many.
    Sets `done.prefill_linear_kernel` when the coded layers' packs change kernel."""
    require_choice("CPU weight codes mode", target.config.cpu_weight_codes, CPU_WEIGHT_CODES_MODES)
    if target.config.cpu_weight_codes == "off" or not done.native_kernels:
        return 0
    kernel = load_coded_linear(target.kernel_cache_dir)
    if kernel is None:
        return 0
    started = time.perf_counter()
    linears = _packed_linears(base, done.lm_head)
    coded = [linear for linear in linears if linear.use_codes(kernel, weight_codes.MAX_ROWS, after_read)]
    _narrow_codes(target.config.cpu_weight_codes, kernel, coded)
    if coded:
        widths = Counter(linear.coded.bits for linear in coded)
        log.info("%d of %d linears kept as exact weight codes (%s; %.0f MB) in %.1f s", len(coded), len(linears),
                 ", ".join(f"{count} of {bits} bits" for bits, count in sorted(widths.items())),
                 sum(linear.coded.nbytes for linear in coded) / 1e6, time.perf_counter() - started)
        # The layers' packs now serve prefill chunks only: the kernel faster there may be
        # another, and under CPU_PREFILL_WEIGHTS=auto oneDNN's, which can be written from the
        # codes (`_wide_from_codes`), unless it is much slower. (The LM head's keeps its kernel:
        # past 32 rows it only serves prompt logprobs. Under CPU_COMPUTE=bfloat16 bfloat16 packs
        # serve those chunks, and these are dropped.)
        config = target.config
        prefill_kernel = None
        if config.cpu_linear_kernel == "auto" and config.cpu_compute == "float32":
            if config.cpu_prefill_weights == "auto":
                prefill_kernel = choose_prefill_kernel(prefer="onednn", tolerance=PREFILL_CODES_TOLERANCE)
            elif config.cpu_prefill_weights == "packs":
                prefill_kernel = choose_prefill_kernel()
        if prefill_kernel is not None:
            for linear in coded:
                if linear is not done.lm_head and linear.kernel != prefill_kernel:
                    linear.repack_for_prefill(prefill_kernel)
            done.prefill_linear_kernel = prefill_kernel
    return len(coded)


def _narrow_codes(mode: str, kernel: NativeCodedLinear, coded: list[PackedLinear]) -> None:
    """Keeps `coded`'s codes in the fewest bits (4-6) that hold them (a matrix no narrower width
    holds stays as it is): `narrow` always, `auto` where timing the model's own linears at both
    widths finds narrow ones faster on this CPU (narrow_calibration.py), `8bit` never. (Either
    way the outputs are the same bit for bit; narrow codes take 0.5-0.75 bytes a weight instead
    of 1.)"""
    if mode not in ("narrow", "auto") or not coded:
        return
    wide = [linear.coded for linear in coded]
    narrow = [kernel.narrow(codes) for codes in wide]
    if mode == "auto":
        if all(ours.bits == theirs.bits for ours, theirs in zip(narrow, wide)):
            return                          # nothing fits in fewer bits
        timings = time_widths(kernel, wide, narrow)
        keep = timings.keeps_narrow
        log.info("weight codes: narrow codes against a byte a code, the model's own linears on this CPU: %s; "
                 "keeping %s", timings.describe(), "narrow codes" if keep else "a byte a code")
        if not keep:
            return
    for linear, codes in zip(coded, narrow):
        linear.coded = codes


def runs_direct_forward(config: EngineConfig, device: torch.device) -> bool:
    """Whether `apply_speedups` gives the base model a direct forward (when its layers are
    ones direct_forward.py writes out): DIRECT_FORWARD=auto on CPU."""
    require_choice("direct forward mode", config.direct_forward, DIRECT_FORWARD_MODES)
    return config.direct_forward == "auto" and device.type == "cpu"


def _direct_forward(target: _Target, base: torch.nn.Module, native_ops: NativeElementwise | None,
                    coded_linears: int) -> DirectForward | None:
    """The base model's forward without transformers' module dispatch (direct_forward.py):
    `auto` on CPU for the layer classes it writes out; None keeps transformers' forward."""
    if not runs_direct_forward(target.config, target.device):
        return None
    direct = DirectForward.create(base, native_ops)
    if direct is not None and direct.native_rope and coded_linears:
        direct.native_layers = NativeDecodeLayers.create(base, direct.layer_types, native_ops,
                                                         target.kernel_cache_dir)
    return direct
