"""Pure parts of the chaos suite (benchmarks/chaos.py): what one stream seen
through a fault counts as, compared with the same request run undisturbed, the
counts per fault, the markdown table and the verdict."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class StreamResult:
    """What a client saw of one streaming completion."""
    status: int = 0                   # HTTP status; 0 when no reply came at all
    text: str = ""
    chunks: int = 0                   # SSE events with a choice (about one per token)
    finish_reason: str | None = None
    error: str | None = None          # an SSE error event, or the transport's exception


@dataclass
class FaultReport:
    fault: str
    streams: int = 0
    accepted: int = 0                 # answered 200
    completed: int = 0                # ended with a finish_reason and no error
    lost: int = 0                     # accepted, then an error or no end
    differed: int = 0                 # completed with text other than the reference's
    duplicated: int = 0               # completed, longer than the reference (text repeated)
    server_errors: int = 0            # 5xx replies
    chunks_at_kill: list[int] = field(default_factory=list)
    recovery_s: float = 0.0           # from the kill until the target's restart returned
    duration_s: float = 0.0
    details: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (self.lost == self.differed == self.duplicated == self.server_errors == 0
                and self.completed == self.streams)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def classify(result: StreamResult, reference: str) -> str:
    """One of: "5xx", "rejected" (another non-200), "lost", "duplicated", "differed", "ok"."""
    if result.status >= 500:
        return "5xx"
    if result.status != 200:
        return "rejected"
    if result.error is not None or result.finish_reason is None:
        return "lost"
    if len(result.text) > len(reference):
        return "duplicated"
    if result.text != reference:
        return "differed"
    return "ok"


def fault_report(fault: str, results: list[StreamResult], references: list[str],
                 chunks_at_kill: list[int], recovery_s: float, duration_s: float) -> FaultReport:
    report = FaultReport(fault=fault, streams=len(results), chunks_at_kill=list(chunks_at_kill),
                         recovery_s=round(recovery_s, 2), duration_s=round(duration_s, 2))
    for index, (result, reference) in enumerate(zip(results, references, strict=True)):
        kind = classify(result, reference)
        report.accepted += result.status == 200
        report.completed += kind in ("ok", "differed", "duplicated")
        report.lost += kind == "lost"
        report.differed += kind == "differed"
        report.duplicated += kind == "duplicated"
        report.server_errors += kind == "5xx"
        if kind != "ok":
            report.details.append(describe(index, kind, result, reference))
    return report


def describe(index: int, kind: str, result: StreamResult, reference: str) -> str:
    same = _common_prefix(result.text, reference)
    return (f"stream {index}: {kind} (status {result.status}, error {result.error!r}, "
            f"finish {result.finish_reason!r}, {len(result.text)} chars vs {len(reference)}, "
            f"first difference at char {same})")


def _common_prefix(a: str, b: str) -> int:
    length = 0
    for x, y in zip(a, b):
        if x != y:
            break
        length += 1
    return length


COLUMNS = ("fault", "streams", "accepted", "completed", "lost", "differed", "duplicated", "5xx",
           "chunks at kill", "recovery s", "ok")


def markdown_table(reports: list[FaultReport]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in reports:
        cut = f"{min(r.chunks_at_kill)}–{max(r.chunks_at_kill)}" if r.chunks_at_kill else "-"
        cells = (r.fault, r.streams, r.accepted, r.completed, r.lost, r.differed, r.duplicated,
                 r.server_errors, cut, f"{r.recovery_s:.1f}", "yes" if r.ok else "**no**")
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def exit_code(reports: list[FaultReport]) -> int:
    return 0 if reports and all(r.ok for r in reports) else 1
