"""PNG curves, one line per system: output tokens/s against concurrency, and
TTFT and TPOT (p50 solid, p99 dashed) and goodput against the Poisson request rate."""

from __future__ import annotations

from pathlib import Path

from benchmarks.head_to_head.report import Point


def _axes(title: str, xlabel: str, ylabel: str):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, axes = plt.subplots(figsize=(6.4, 4.2), dpi=110)
    axes.set_title(title)
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    axes.grid(True, alpha=0.3)
    return plt, figure, axes


def _save(plt, figure, axes, path: Path) -> Path:
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return path


def _series(points: list[Point], system: str, kind: str, field: str) -> tuple[list[float], list[float]]:
    chosen = sorted((p for p in points if p.system == system and p.kind == kind), key=lambda p: p.x)
    pairs = [(p.x, getattr(p, field)) for p in chosen if getattr(p, field) is not None]
    return [x for x, _ in pairs], [y for _, y in pairs]


def throughput_vs_concurrency(points: list[Point], systems: list[str], path: Path, title: str) -> Path:
    plt, figure, axes = _axes(f"Output tokens/s vs concurrency\n{title}", "requests in flight", "output tokens/s")
    ticks: set[float] = set()
    for system in systems:
        xs, ys = _series(points, system, "concurrency", "output_tokens_per_s")
        if xs:
            axes.plot(xs, ys, marker="o", label=system)
            ticks.update(xs)
    axes.set_xscale("log", base=2)
    axes.set_xticks(sorted(ticks), [f"{x:g}" for x in sorted(ticks)])
    axes.set_ylim(bottom=0)
    return _save(plt, figure, axes, path)


def latency_vs_rate(points: list[Point], systems: list[str], metric: str, path: Path, title: str) -> Path:
    """`metric` is "ttft" or "tpot": p50 solid, p99 dashed, one colour per system."""
    plt, figure, axes = _axes(f"{metric.upper()} vs request rate (p50 solid, p99 dashed)\n{title}",
                              "Poisson request rate (req/s)", f"{metric.upper()} (ms)")
    for index, system in enumerate(systems):
        colour = f"C{index}"
        for quantile, style in (("p50", "-"), ("p99", "--")):
            xs, ys = _series(points, system, "rate", f"{metric}_{quantile}_ms")
            if xs:
                axes.plot(xs, ys, style, marker="o", color=colour, label=f"{system} {quantile}")
    axes.set_yscale("log")
    return _save(plt, figure, axes, path)


def goodput_vs_rate(points: list[Point], systems: list[str], path: Path, title: str) -> Path:
    plt, figure, axes = _axes(f"Goodput vs request rate\n{title}", "Poisson request rate (req/s)",
                              "requests within SLO per s")
    for system in systems:
        xs, ys = _series(points, system, "rate", "goodput_per_s")
        if xs:
            axes.plot(xs, ys, marker="o", label=system)
    axes.set_ylim(bottom=0)
    return _save(plt, figure, axes, path)


def write_all(points: list[Point], systems: list[str], directory: Path, title: str) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    return [throughput_vs_concurrency(points, systems, directory / "throughput_vs_concurrency.png", title),
            latency_vs_rate(points, systems, "ttft", directory / "ttft_vs_rate.png", title),
            latency_vs_rate(points, systems, "tpot", directory / "tpot_vs_rate.png", title),
            goodput_vs_rate(points, systems, directory / "goodput_vs_rate.png", title)]
