"""CPU_COMPUTE=bfloat16: the layers' wide GEMMs in bfloat16 on CPUs with BF16 instructions.

Opt-in and lossy. The model stays float32: embeddings, norms, attention, residuals, the
LM head and sampling are untouched. Each decoder layer's packed linear (cpu_linear.py)
gets a bfloat16 copy of its weight reordered into oneDNN's blocked layout, and steps of at
least `min_rows` rows (prefill chunks, wide decode batches) round their float32 input to
bfloat16, run oneDNN's bfloat16 GEMM (float32 accumulation; torch's op writes its output
in bfloat16) and widen the output back to float32. Fewer rows keep their float32 path
(weight codes, the C few-row kernel, the float32 pack), bit for bit.

`min_rows` is measured at start on the model's own first layer, as the float32 kernels
are picked: the smallest calibrated row count from which the bfloat16 GEMM is faster than
the float32 path at that and every larger calibrated count, the largest being a prefill
chunk's 256 rows. Where bfloat16 is not faster even there (a CPU whose BF16 instructions
do not pay for the conversions: an Intel Xeon with AVX512-BF16 ran the default model's
prefill at 0.70x), no step runs in bfloat16 and nothing is copied: the layers stay
float32, exact, and a warning says so. That is checked first, before any speed-up is
applied (`bfloat16_pays`, on the first layer's plain linears at 256 rows), so that such a
worker is the float32 one in everything, its memory included. A linear whose few rows run from weight codes
needs no float32 copy once bfloat16 takes every wider step: its float32 pack and weight
are dropped (with the other unread copies, speedups.py), so the bfloat16 copy replaces
the float32 pack (half its bytes). A linear
without codes keeps its float32 path for the few rows, and holds the bfloat16 copy besides.

A CPU without AVX512-BF16 or AMX-BF16 is refused at start (an explicit request for a
faster lossy mode should not silently run a slower emulated one).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from services.worker.engine.cpu.linear.cpu_linear import PackedLinear, bfloat16_linear, onednn_bf16_packing_available
from services.worker.engine.cpu.timing import best_alternating

log = logging.getLogger(__name__)

CPU_COMPUTE_MODES = ("float32", "bfloat16")          # CPU_COMPUTE
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
PREFILL_ROWS = 256           # a prefill chunk's rows
CALIBRATION_ROWS = (1, 4, 8, 16, 32, PREFILL_ROWS)
PACK_ROWS_HINT = 512


@dataclass(frozen=True)
class Bfloat16Compute:
    """What CPU_COMPUTE=bfloat16 set up: how many linears hold a bfloat16 pack, from how many rows
    on (None: from none, bfloat16 being slower here at every calibrated size)."""
    linears: int
    min_rows: int | None


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The instruction-set flags the kernel reports for this CPU (empty where unreadable)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()


def require_bfloat16_cpu(flags: set[str] | None = None) -> None:
    """Raises ValueError naming CPU_COMPUTE unless this CPU runs oneDNN's bfloat16 GEMMs natively."""
    flags = cpu_flags() if flags is None else flags
    found = [flag for flag in BF16_CPU_FLAGS if flag in flags]
    if not found:
        raise ValueError("CPU_COMPUTE=bfloat16 needs a CPU with BF16 instructions "
                         f"({' or '.join(BF16_CPU_FLAGS)}); this one has neither: unset CPU_COMPUTE or use float32")
    if not onednn_bf16_packing_available():
        raise ValueError("CPU_COMPUTE=bfloat16 needs torch's oneDNN bfloat16 linear, which this torch build lacks")


def prefill_seconds(linears: list[torch.nn.Linear]) -> tuple[float, float]:
    """Seconds of `linears` (one layer's, unpacked) on a prefill chunk of PREFILL_ROWS rows:
    (float32, bfloat16 on its oneDNN pack)."""
    generator = torch.Generator().manual_seed(5)
    inputs = [torch.rand(PREFILL_ROWS, linear.in_features, generator=generator) for linear in linears]
    packs = [pack_bfloat16(linear.weight) for linear in linears]
    biases = [_bfloat16(linear.bias) for linear in linears]
    with torch.inference_mode():
        return best_alternating((
            lambda: [torch.nn.functional.linear(x, linear.weight, linear.bias) for linear, x in zip(linears, inputs)],
            lambda: [bfloat16_linear(x, pack, bias) for x, pack, bias in zip(inputs, packs, biases)]), repeats=5)


def bfloat16_pays(base: torch.nn.Module) -> bool:
    """Whether the first decoder layer's linears run a prefill chunk faster in bfloat16 than
    in float32 on this CPU; when not, a warning naming CPU_COMPUTE says the layers stay float32."""
    layers = getattr(base, "layers", None) or []
    linears = [m for m in layers[0].modules() if isinstance(m, torch.nn.Linear)] if len(layers) else []
    if not linears:
        return True     # apply_bfloat16 says what is wrong
    float32, bfloat16 = prefill_seconds(linears)
    if bfloat16 < float32:
        return True
    log.warning("CPU_COMPUTE=bfloat16: bfloat16 GEMMs are not faster than float32 on this CPU even at a "
                "%d-row prefill chunk (the first layer's linears: %.2f ms in float32, %.2f in bfloat16), so "
                "the worker runs float32 (exact); unset CPU_COMPUTE to skip this check",
                PREFILL_ROWS, float32 * 1000, bfloat16 * 1000)
    return False


def pack_bfloat16(weight: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(torch.bfloat16), PACK_ROWS_HINT)


def first_win(seconds: dict[int, tuple[float, float]]) -> int | None:
    """The smallest row count from which bfloat16 (second) beats float32 (first) at it and
    at every larger one in `seconds` (past the largest, as at the largest); None when it
    does not beat it at the largest."""
    chosen = None
    for count in sorted(seconds, reverse=True):
        float32, bfloat16 = seconds[count]
        if bfloat16 >= float32:
            break
        chosen = count
    return chosen


def measure(linears: list[PackedLinear], packs: list[torch.Tensor]) -> dict[int, tuple[float, float]]:
    """Seconds of `linears` (one layer's) per calibrated row count: (their float32 path, bfloat16)."""
    generator = torch.Generator().manual_seed(3)
    biases = [_bfloat16(linear.bias) for linear in linears]
    seconds = {}
    with torch.inference_mode():
        for rows in CALIBRATION_ROWS:
            inputs = [torch.rand(rows, linear.in_features, generator=generator) for linear in linears]
            float32, bfloat16 = best_alternating((
                lambda: [linear(x) for linear, x in zip(linears, inputs)],
                lambda: [bfloat16_linear(x, pack, bias) for x, pack, bias in zip(inputs, packs, biases)]), repeats=7)
            seconds[rows] = (float32, bfloat16)
    return seconds


def _bfloat16(bias: torch.Tensor | None) -> torch.Tensor | None:
    return bias.detach().to(torch.bfloat16) if bias is not None else None


def layer_linears(base: torch.nn.Module) -> list[list[PackedLinear]]:
    """Each decoder layer's packed linears (the LM head is not one of them)."""
    layers = getattr(base, "layers", None) or []
    return [[m for m in layer.modules() if isinstance(m, PackedLinear)] for layer in layers]


Timer = Callable[[list[PackedLinear], list[torch.Tensor]], dict[int, tuple[float, float]]]


def apply_bfloat16(base: torch.nn.Module, timer: Timer | None = None) -> Bfloat16Compute:
    """Gives every decoder layer's packed linear its bfloat16 pack, from the measured row
    count on (`timer`: seconds per row count of the first layer's linears, by default
    `measure`). The float32 copies this leaves unread are dropped with the others
    (speedups.py, `PackedLinear.drop_float32_weight`)."""
    layers = [linears for linears in layer_linears(base) if linears]
    if not layers:
        raise ValueError("CPU_COMPUTE=bfloat16 runs the layers' packed linears, and this model has none "
                         "(packed weights off, or not a CPU float32 model)")
    first = [pack_bfloat16(linear.weight) for linear in layers[0]]
    seconds = (timer or measure)(layers[0], first)
    min_rows = first_win(seconds)
    timings = ", ".join(f"{rows} rows {f * 1000:.2f}/{b * 1000:.2f} ms" for rows, (f, b) in seconds.items())
    if min_rows is None:
        log.warning("CPU_COMPUTE=bfloat16: bfloat16 GEMMs are not faster than float32 on this CPU at any calibrated "
                    "size, so the layers stay float32 (exact); unset CPU_COMPUTE to skip this calibration "
                    "(float32/bfloat16: %s)", timings)
        return Bfloat16Compute(linears=0, min_rows=None)
    log.info("CPU_COMPUTE=bfloat16: layer GEMMs of %d rows or more in bfloat16 (calibration, float32/bfloat16: %s)",
             min_rows, timings)
    for linear, pack in zip(layers[0], first):
        linear.use_bfloat16(pack, min_rows)
    for linears in layers[1:]:
        for linear in linears:
            linear.use_bfloat16(pack_bfloat16(linear.weight), min_rows)
    return Bfloat16Compute(linears=sum(map(len, layers)), min_rows=min_rows)


def holds_bfloat16(linears: Iterable[torch.nn.Module]) -> int:
    """How many of `linears` hold a bfloat16 pack."""
    return sum(1 for m in linears if isinstance(m, PackedLinear) and m.bf16_packed is not None)
