"""Linear layers with pre-packed weights, for CPU decode batches.

Two packed float32 kernels, and which one is faster depends on the CPU:

* MKL (`mkl`): sgemm repacks the weight matrix on every call; for the few-row
  inputs of decode steps that costs more than the multiply itself, so the weight
  is packed once. On Intel Xeons (AVX-512, 2 threads, default model) the layers'
  640x2048-sized weights run 1.1-3x faster packed up to 32 rows and break even
  near 64; the 262k x 640 LM head is 2.4x faster packed at 8 rows but slower
  from 16 rows on. So layers take it up to 32 rows, the LM head up to 8, and
  larger inputs the plain kernel.
* oneDNN (`onednn`): the weight reordered once into oneDNN's blocked layout.
  On AMD EPYC (AVX2) MKL's few-row sgemm is slow whether packed or not (the LM
  head at 8 rows: 185 ms packed, 285 ms plain), and oneDNN's is 2.4x faster
  there (76 ms), 2x faster on the layers' shapes at 8-32 rows and ~15 % faster
  at 512-row prefill chunks, so it takes every row count.

`choose_float32_kernel` times both on this CPU once per process (`auto`).
bfloat16 has one packed kernel, oneDNN's (AMX or AVX512-BF16 where the CPU has
them): 1-32 rows run 1.3-2.4x faster on the layers' shapes and the LM head at
32 rows 1.6x faster, while 512-row chunks are faster with the plain kernel.
Every kind keeps the original weight (shared, e.g. a tied embedding) beside the
pack, which costs one more copy of the weights in memory, until the weight codes
(weight_codes.py) take the few-row steps: then a layer whose pack is oneDNN's for
every row count drops its float32 weight (the pack serves prefill alone), and the
LM head drops its pack (its few rows run from the codes; more rows, which only
prompt logprobs and very wide steps ask for, from the plain float32 weight).
Under CPU_COMPUTE=bfloat16 (bf16_compute.py) a layer's linear also holds a bfloat16 pack
for its wide steps (`use_bfloat16`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.worker.engine.cpu.linear.coded_wide import WideFromCodes
from services.worker.engine.cpu.kernels.native_ops import NativeSkinnyLinear
from services.worker.engine.cpu.linear.weight_codes import PANEL, CodedWeight, NativeCodedLinear

log = logging.getLogger(__name__)

PACK_ROWS_HINT = 8     # the pack's size and layout are the same for any row count
PREFILL_PACK_ROWS_HINT = 512
MAX_PACKED_ROWS = 32       # MKL-packed layer weights, and oneDNN-packed bfloat16 ones
MKL_LM_HEAD_MAX_PACKED_ROWS = 8
ALL_ROWS = 1 << 62
CODED_TILE_ROWS = 16384    # output rows per float32 tile a code-only linear expands for a wide step

KERNEL_CHOICES = ("auto", "mkl", "onednn")   # CPU_LINEAR_KERNEL
# What the calibration times: a layer-sized weight and a slice of a large vocabulary's
# LM head (bigger than the caches, as the whole head is), at decode-sized row counts.
CALIBRATION_SHAPES = ((2048, 640), (32768, 640))
CALIBRATION_ROWS = (1, 8, 32)
# What the prefill calibration times: a layer-sized weight at a prefill chunk's row count.
PREFILL_CALIBRATION_SHAPE = (2048, 640)
PREFILL_CALIBRATION_ROWS = 256
# Rounds of it, alternating the kernels, each kernel's best kept: one round's ratio moved
# between 0.75 and 1.11 from start to start on a 2-core AMD EPYC Zen 3.
PREFILL_CALIBRATION_ROUNDS = 5


@dataclass(frozen=True)
class KernelPlan:
    """Which packed kernel a dtype's linears use, and up to how many rows
    (layers and LM head); larger inputs take the plain kernel."""
    kernel: str                 # "mkl" | "onednn"
    layer_max_rows: int
    lm_head_max_rows: int


def mkl_packing_available() -> bool:
    return hasattr(torch.ops, "mkl") and hasattr(torch.ops.mkl, "_mkl_linear") and torch.backends.mkl.is_available()


def _onednn_ops_available() -> bool:
    mkldnn = getattr(torch.ops, "mkldnn", None)
    return (torch.backends.mkldnn.is_available() and mkldnn is not None
            and hasattr(mkldnn, "_linear_pointwise") and hasattr(mkldnn, "_reorder_linear_weight"))


def onednn_bf16_packing_available() -> bool:
    return _onednn_ops_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def kernel_available(kernel: str, dtype: torch.dtype) -> bool:
    if dtype == torch.float32:
        return mkl_packing_available() if kernel == "mkl" else kernel == "onednn" and _onednn_ops_available()
    if dtype == torch.bfloat16:
        return kernel == "onednn" and onednn_bf16_packing_available()
    return False


def packing_available(dtype: torch.dtype) -> bool:
    return any(kernel_available(kernel, dtype) for kernel in ("mkl", "onednn"))


def kernel_plan(kernel: str, dtype: torch.dtype) -> KernelPlan:
    """The row limits each kernel is worth using for (see the module docstring)."""
    if not kernel_available(kernel, dtype):
        raise ValueError(f"CPU linear kernel {kernel!r}: no packed {kernel} kernel for {dtype} on this CPU")
    if kernel == "mkl":
        return KernelPlan("mkl", MAX_PACKED_ROWS, MKL_LM_HEAD_MAX_PACKED_ROWS)
    if dtype == torch.float32:
        return KernelPlan("onednn", ALL_ROWS, ALL_ROWS)
    return KernelPlan("onednn", MAX_PACKED_ROWS, MAX_PACKED_ROWS)


def resolve_kernel_plan(choice: str, dtype: torch.dtype,
                        timer: Callable[[str], float] | None = None) -> KernelPlan | None:
    """The plan for `choice` (CPU_LINEAR_KERNEL), or None when `dtype` has no packed
    kernel here. `auto` takes bfloat16's only kernel, and for float32 the faster one
    on this CPU (`timer(kernel)` -> seconds; by default a measurement, once per process)."""
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"unknown CPU linear kernel {choice!r}; expected one of {', '.join(KERNEL_CHOICES)}")
    if choice != "auto":
        return kernel_plan(choice, dtype)
    available = [kernel for kernel in ("mkl", "onednn") if kernel_available(kernel, dtype)]
    if not available:
        return None
    if len(available) == 1:
        return kernel_plan(available[0], dtype)
    return kernel_plan(choose_float32_kernel(timer), dtype)


_chosen_float32_kernel: str | None = None


def choose_float32_kernel(timer: Callable[[str], float] | None = None) -> str:
    """The packed float32 kernel that runs the calibration shapes faster here. The
    measured choice is kept for the process: every engine in it shares the CPU."""
    global _chosen_float32_kernel
    measured = timer is None
    if measured and _chosen_float32_kernel is not None:
        return _chosen_float32_kernel
    if timer is None:
        linears = _calibration_linears()
        timer = lambda kernel: _time_kernel(kernel, linears)  # noqa: E731
    chosen = _pick({kernel: timer(kernel) for kernel in ("mkl", "onednn")}, "linear")
    if measured:
        _chosen_float32_kernel = chosen
    return chosen


def _pick(seconds: dict[str, float], what: str, prefer: str | None = None, tolerance: float = 1.0) -> str:
    """The kernel with the fewest `seconds`, or `prefer` where it is within `tolerance` x that
    kernel's time, logged with every measurement."""
    fastest = min(seconds, key=seconds.__getitem__)
    chosen = prefer if prefer in seconds and seconds[prefer] <= tolerance * seconds[fastest] else fastest
    log.info("packed float32 %s kernel: %s (calibration: %s%s)", what, chosen,
             ", ".join(f"{kernel} {value * 1000:.1f} ms" for kernel, value in seconds.items()),
             f"; {prefer} taken within {tolerance - 1:.0%} of the fastest" if chosen != fastest else "")
    return chosen


# oneDNN's prefill pack can be written from a coded layer's codes (coded_wide.py), so that the
# layer keeps no float32 copy for prefill (~900 MB on the default model); MKL's pack cannot. Where
# a coded model's wide steps may run from the codes (CPU_PREFILL_WEIGHTS=auto), oneDNN is taken
# for prefill unless MKL ran the calibration chunk more than this much faster. (On a 2-core AMD
# EPYC Zen 3 a one-round calibration put MKL up to 11 % ahead at 256 rows, and W1's prefill and
# end-to-end rates at a 2,048-token budget came out the same on either.)
PREFILL_CODES_TOLERANCE = 1.15

_prefill_seconds: dict[str, float] | None = None


def choose_prefill_kernel(timer: Callable[[str], float] | None = None, prefer: str | None = None,
                          tolerance: float = 1.0) -> str | None:
    """The packed float32 kernel for prefill-sized chunks, or None where neither is available:
    the one the calibration runs faster (MKL's packed sgemm was ~11 % faster than oneDNN's at
    512 rows on an Intel Xeon), or `prefer` where it is within `tolerance` x the faster one's
    time. The measurement is kept for the process."""
    global _prefill_seconds
    available = [kernel for kernel in ("mkl", "onednn") if kernel_available(kernel, torch.float32)]
    if len(available) < 2:
        return available[0] if available else None
    if timer is None and _prefill_seconds is None:
        _prefill_seconds = dict.fromkeys(available, float("inf"))
        for _ in range(PREFILL_CALIBRATION_ROUNDS):    # alternating: the machine's drift hits both
            for kernel in available:
                _prefill_seconds[kernel] = min(_prefill_seconds[kernel], _time_prefill_kernel(kernel))
    seconds = _prefill_seconds if timer is None else {kernel: timer(kernel) for kernel in available}
    return _pick(seconds, "prefill", prefer, tolerance)


def _time_prefill_kernel(kernel: str, repeats: int = 3) -> float:
    generator = torch.Generator().manual_seed(2)
    linear = _random_linear(*PREFILL_CALIBRATION_SHAPE, generator)
    packed = PackedLinear(linear, ALL_ROWS, kernel, pack_rows_hint=PREFILL_PACK_ROWS_HINT)
    x = torch.rand(PREFILL_CALIBRATION_ROWS, linear.in_features, generator=generator)
    best = float("inf")
    with torch.inference_mode():
        packed(x)   # warm-up
        for _ in range(repeats):
            started = time.perf_counter()
            packed(x)
            best = min(best, time.perf_counter() - started)
    return best


def _random_linear(out_features: int, in_features: int, generator: torch.Generator) -> torch.nn.Linear:
    # built on the meta device and handed its weight (not skip_init, whose to_empty imports
    # torch's compiler stack, ~35 MB resident, into a worker that never compiles)
    linear = torch.nn.Linear(in_features, out_features, bias=False, device="meta")
    weight = torch.empty(out_features, in_features).uniform_(-0.05, 0.05, generator=generator)
    linear.weight = torch.nn.Parameter(weight)
    return linear


def _calibration_linears() -> list[torch.nn.Linear]:
    generator = torch.Generator().manual_seed(0)
    return [_random_linear(out_features, in_features, generator) for out_features, in_features in CALIBRATION_SHAPES]


def _time_kernel(kernel: str, linears: list[torch.nn.Linear], repeats: int = 2) -> float:
    """Sum over the calibration linears and row counts of the best of `repeats` calls."""
    generator = torch.Generator().manual_seed(1)
    total = 0.0
    with torch.inference_mode():
        for linear in linears:
            packed = PackedLinear(linear, kernel_plan(kernel, torch.float32).layer_max_rows, kernel)
            for rows in CALIBRATION_ROWS:
                x = torch.rand(rows, linear.in_features, generator=generator)
                packed(x)   # warm-up
                best = float("inf")
                for _ in range(repeats):
                    started = time.perf_counter()
                    packed(x)
                    best = min(best, time.perf_counter() - started)
                total += best
    return total


class PackedLinear(torch.nn.Module):
    def __init__(self, linear: torch.nn.Linear, max_packed_rows: int = MAX_PACKED_ROWS,
                 kernel: str | None = None, pack_rows_hint: int = PACK_ROWS_HINT, pack: bool = True) -> None:
        """`pack=False` defers the pack to `pack_now` (until then the plain weight serves the
        steps the pack would): the engine packs only the linears whose weight codes leave a
        step for the pack, so that no pack is built only to be dropped."""
        super().__init__()
        dtype = linear.weight.dtype
        kernel = kernel or _default_kernel(dtype) or "onednn"
        if not kernel_available(kernel, dtype):
            raise ValueError(f"no packed kernel for {dtype} ({kernel}) on this CPU")
        self.kernel = kernel
        self.max_packed_rows = max_packed_rows
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.weight = linear.weight          # kept (shared, e.g. a tied embedding); the pack is extra
        self.bias = linear.bias
        self.native: NativeSkinnyLinear | None = None    # the C kernel for the fewest rows, if routed
        self.native_max_rows = 0
        self.coded: CodedWeight | None = None        # the weight as exact 8-bit codes, if it is one
        self.coded_kernel: NativeCodedLinear | None = None
        self.coded_max_rows = 0
        self.bf16_packed: torch.Tensor | None = None     # CPU_COMPUTE=bfloat16: a bfloat16 oneDNN pack
        self.bf16_bias: torch.Tensor | None = None
        self.bf16_min_rows = ALL_ROWS
        self.wide: WideFromCodes | None = None          # CPU_PREFILL_WEIGHTS=codes: wide steps from the codes
        self.deferred_rows_hint: int | None = None if pack else pack_rows_hint   # a pack to build (`pack_now`)
        self.register_buffer("packed", self._pack(kernel, pack_rows_hint) if pack else None, persistent=False)

    def pack_now(self) -> bool:
        """Builds the deferred pack; False when none is deferred."""
        if self.deferred_rows_hint is None or self.weight is None:
            return False
        self.packed = self._pack(self.kernel, self.deferred_rows_hint)
        self.deferred_rows_hint = None
        return True

    def _pack(self, kernel: str, rows_hint: int) -> torch.Tensor:
        with torch.no_grad():
            weight = self.weight.detach()
            return (torch.ops.mkl._mkl_reorder_linear_weight(weight, rows_hint) if kernel == "mkl"
                    else torch.ops.mkldnn._reorder_linear_weight(weight, rows_hint))

    def repack_for_prefill(self, kernel: str) -> None:
        """The pack replaced by `kernel`'s for every row count: for a linear whose few-row
        steps the coded kernel serves, so that the pack only runs prefill chunks."""
        if not kernel_available(kernel, self.weight.dtype):
            raise ValueError(f"no packed kernel for {self.weight.dtype} ({kernel}) on this CPU")
        if self.deferred_rows_hint is not None:
            self.deferred_rows_hint = PREFILL_PACK_ROWS_HINT
        else:
            self.packed = self._pack(kernel, PREFILL_PACK_ROWS_HINT)
        self.kernel, self.max_packed_rows = kernel, ALL_ROWS

    def drop_float32_weight(self) -> bool:
        """Drops the float32 weight where nothing reads it any more: codes serve the
        few-row steps and oneDNN's pack (which never reads the weight) all the others.
        With a bfloat16 pack serving every step the codes do not, the float32 pack goes too."""
        if self.coded is None or self.weight is None or self.weight.dtype != torch.float32:
            return False
        if self.bf16_packed is not None and self.coded_max_rows >= self.bf16_min_rows - 1:
            self.packed, self.max_packed_rows = None, 0
        elif self.kernel != "onednn" or self.max_packed_rows != ALL_ROWS:
            return False
        self.weight, self.native, self.native_max_rows = None, None, 0
        return True

    def drop_pack(self) -> bool:
        """Drops the pack (or the deferred one): codes serve the few-row steps, the plain
        float32 weight the others."""
        if self.coded is None or (self.packed is None and self.deferred_rows_hint is None) or self.weight is None:
            return False
        self.packed, self.max_packed_rows, self.deferred_rows_hint = None, 0, None
        return True

    def serve_all_rows_from_codes(self) -> bool:
        """Drops the float32 weight of a coded linear without a pack (the LM head after
        `drop_pack`): steps wider than the codes' kernel takes multiply float32 tiles of
        CODED_TILE_ROWS output rows expanded from the codes (the same values, bit for bit)."""
        if self.coded is None or self.packed is not None or self.weight is None:
            return False
        self.weight, self.native, self.native_max_rows = None, None, 0
        return True

    def keep_codes_in_half_form(self) -> bool:
        """Keeps the codes' scales as half floats and their offsets as byte zeros where they are
        exactly that (weight_codes.py's half form: a Q8_0 head), 3 bytes a block instead of 8;
        every kernel reading them gives the same outputs. False (nothing changes) otherwise."""
        half = self.coded.half_form() if self.coded is not None else None
        if half is None or half is self.coded:
            return False
        self.coded = half
        return True

    def serve_wide_rows_from_codes(self, wide: WideFromCodes) -> bool:
        """Drops the float32 weight and pack of a coded linear: steps wider than the codes'
        kernel takes (and not served by a bfloat16 pack) multiply the weight expanded from
        the codes by `wide` (coded_wide.py), the same values bit for bit."""
        if self.coded is None:
            return False
        self.weight, self.packed, self.max_packed_rows, self.deferred_rows_hint = None, None, 0, None
        self.native, self.native_max_rows, self.wide = None, 0, wide
        return True

    def _from_code_tiles(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = torch.empty(rows.shape[0], self.out_features, dtype=x.dtype)
        step = max(PANEL, CODED_TILE_ROWS // PANEL * PANEL)        # whole panels a tile
        scratch = torch.empty(min(step, self.out_features) * self.in_features)
        for start in range(0, self.out_features, step):
            end = min(start + step, self.out_features)
            tile = self.coded_kernel.expand_into(self.coded.panel_rows(start, end), scratch).to(x.dtype)
            bias = self.bias[start:end] if self.bias is not None else None
            out[:, start:end] = torch.nn.functional.linear(rows, tile, bias)
        return out.view(*x.shape[:-1], self.out_features)

    def use_bfloat16(self, packed: torch.Tensor, min_rows: int) -> None:
        """Steps of at least `min_rows` rows run through `packed`, a bfloat16 oneDNN pack of
        this weight; fewer keep their float32 path (codes, C kernel or float32 pack)."""
        self.bf16_packed, self.bf16_min_rows = packed, min_rows
        self.bf16_bias = self.bias.detach().to(torch.bfloat16) if self.bias is not None else None
        self.native_max_rows = min(self.native_max_rows, min_rows - 1)
        self.coded_max_rows = min(self.coded_max_rows, min_rows - 1)

    def use_native(self, kernel: NativeSkinnyLinear, max_rows: int) -> bool:
        """Routes steps of at most `max_rows` rows to the C kernel (float32, contiguous weight)."""
        weight = self.weight
        if (weight.dtype != torch.float32 or not weight.is_contiguous()
                or (self.bias is not None and (self.bias.dtype != torch.float32 or not self.bias.is_contiguous()))):
            return False
        self.native, self.native_max_rows = kernel, max_rows
        return True

    def use_codes(self, kernel: NativeCodedLinear, max_rows: int,
                  after_rows: Callable[[torch.Tensor], object] | None = None) -> bool:
        """Routes steps of at most `max_rows` rows to the coded kernel when the weight is
        exact 8-bit codes (weight_codes.py); the float32 weight stays for larger steps.
        `after_rows`: called with each chunk of the weight once its codes have read it."""
        if self.bias is not None and (self.bias.dtype != torch.float32 or not self.bias.is_contiguous()):
            return False
        coded = kernel.find(self.weight, after_rows)
        if coded is None:
            return False
        self.coded, self.coded_kernel, self.coded_max_rows = coded, kernel, max_rows
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if self.coded is not None and rows.shape[0] <= self.coded_max_rows and x.dtype == torch.float32:
            out = self.coded_kernel(rows.contiguous(), self.coded, self.bias)
            return out.view(*x.shape[:-1], self.out_features)
        if self.native is not None and rows.shape[0] <= self.native_max_rows and x.dtype == torch.float32:
            out = self.native(rows.contiguous(), self.weight, self.bias)
            return out.view(*x.shape[:-1], self.out_features)
        if self.bf16_packed is not None and rows.shape[0] >= self.bf16_min_rows and x.dtype == torch.float32:
            out = bfloat16_linear(rows, self.bf16_packed, self.bf16_bias)
            return out.view(*x.shape[:-1], self.out_features)
        if self.wide is not None:
            return self.wide(rows.contiguous(), self.coded, self.bias).view(*x.shape[:-1], self.out_features)
        if rows.shape[0] > self.max_packed_rows or self.packed is None:
            if self.weight is None and self.packed is None:
                return self._from_code_tiles(x)
            if self.weight is None:
                raise RuntimeError("a step the codes do not serve reached a linear without its weight")
            return torch.nn.functional.linear(x, self.weight, self.bias)
        if self.kernel == "mkl":
            out = torch.ops.mkl._mkl_linear(rows, self.packed, self.weight, self.bias, rows.shape[0])
        else:
            out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)


def bfloat16_linear(rows: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """float32 rows [N, in] through a bfloat16 oneDNN pack: float32 [N, out]. oneDNN accumulates
    in float32; torch's op writes its output in bfloat16, widened here."""
    return torch.ops.mkldnn._linear_pointwise(rows.to(torch.bfloat16), packed, bias, "none", [], "").float()


def pack_linears(module: torch.nn.Module, plans: dict[torch.dtype, KernelPlan] | None = None,
                 pack: bool = True) -> int:
    """Replaces every nn.Linear under `module` whose dtype has a plan (by default: a
    packed kernel here) by a PackedLinear (its pack deferred with `pack=False`); returns how many."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, torch.nn.Linear):
            plan = _plan_for(child.weight.dtype, plans)
            if plan is not None:
                setattr(module, name, PackedLinear(child, plan.layer_max_rows, plan.kernel, pack=pack))
                count += 1
        else:
            count += pack_linears(child, plans, pack)
    return count


def _plan_for(dtype: torch.dtype, plans: dict[torch.dtype, KernelPlan] | None) -> KernelPlan | None:
    if plans is not None:
        return plans.get(dtype)
    kernel = _default_kernel(dtype)
    return kernel_plan(kernel, dtype) if kernel is not None else None


def _default_kernel(dtype: torch.dtype) -> str | None:
    """The packed kernel used without a measured choice: MKL for float32 where it is
    available, else oneDNN; None where `dtype` has neither."""
    return next((kernel for kernel in ("mkl", "onednn") if kernel_available(kernel, dtype)), None)
