"""The step profile's tables: per kind of step (with prefill chunks, decodes only) and
over the whole run, each category's milliseconds per step, its share of the step, and
for the layer GEMMs their achieved GFLOP/s against the kernel's peak on the same shapes."""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.step_profile.clock import StepClock
from benchmarks.step_profile.instrument import GEMMS

ORDER = (GEMMS, "attention", "norms", "RoPE", "MLP activation", "embedding + rotary tables",
         "layers in one C call", "forward glue", "LM head + screen", "screen: integer pass", "screen: top-k",
         "screen: exact logits", "screen: pick (C)", "sampler", "sampling glue", "step inputs", "planning", "commit",
         "engine Python")
KIND_NAMES = {"prefill": "steps with prefill chunks", "decode": "decode-only steps"}


@dataclass(frozen=True)
class Peak:
    """The GEMM kernel's own rate on one layer's shapes at `rows` rows (gemm_peak.py)."""
    kernel: str
    rows: int
    gflops: float | None


def _gflops(flops: float, seconds: float) -> float | None:
    return flops / seconds / 1e9 if flops and seconds > 0 else None


def _rate_cells(flops: float, seconds: float, peak: Peak | None) -> tuple[str, str]:
    achieved = _gflops(flops, seconds)
    if achieved is None:
        return "", ""
    if peak is None or not peak.gflops:
        return f"{achieved:,.0f}", ""
    return f"{achieved:,.0f}", (f"{achieved / peak.gflops:.0%} of {peak.gflops:,.0f} ({peak.kernel} alone, "
                                f"{peak.rows} rows)")


def kind_table(clock: StepClock, kind: str, peak: Peak | None) -> str:
    steps = clock.steps[kind]
    total = clock.step_seconds[kind]
    lines = [f"{KIND_NAMES[kind]}: {steps} steps, {clock.step_rows[kind] / steps:,.0f} rows (tokens) per step, "
             f"{total / steps * 1000:,.1f} ms per step", "",
             "| component | ms per step | share | GFLOP/s | vs kernel peak |", "|---|---:|---:|---:|---|"]
    for category in ORDER:
        seconds = clock.seconds.get((kind, category), 0.0)
        if not seconds:
            continue
        rate, versus = _rate_cells(clock.flops.get((kind, category), 0.0), seconds, peak)
        lines.append(f"| {category} | {seconds / steps * 1000:,.2f} | {seconds / total:.1%} | {rate} | {versus} |")
    return "\n".join(lines)


def run_table(clock: StepClock, wall_s: float) -> str:
    """The whole run: each category's seconds and share of the run's wall time, the
    driver's own time between steps included."""
    lines = ["| component | s in the run | share |", "|---|---:|---:|"]
    for category in ORDER:
        seconds = sum(clock.seconds.get((kind, category), 0.0) for kind in clock.kinds())
        if seconds:
            lines.append(f"| {category} | {seconds:,.2f} | {seconds / wall_s:.1%} |")
    between = wall_s - sum(clock.step_seconds.values())
    lines.append(f"| driver between steps (the scheduler's stand-in) | {between:,.2f} | {between / wall_s:.1%} |")
    return "\n".join(lines)
