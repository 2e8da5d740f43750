"""The head-to-head's resident-memory readings: peaks and closing figures per service
from a fake process reader, a point carrying them into the JSON and the table, and
the option that leaves the Poisson points out."""

from __future__ import annotations

import asyncio
import os

from benchmarks.head_to_head.__main__ import make_plan, parse_args
from benchmarks.head_to_head.report import Slo, point, table, to_json
from benchmarks.head_to_head.resident import Resident, ResidentSampler, render_services
from benchmarks.head_to_head.sweep import Plan, PointRun, sampled
from benchmarks.head_to_head.systems import Served
from benchmarks.memory import MB
from tests.unit.benchmarks.test_head_to_head import record


class ScriptedReader:
    """Resident bytes per pid, one scripted value per reading (the last one repeats)."""

    def __init__(self, script: dict[int, list[float]]) -> None:
        self.script = {pid: list(values) for pid, values in script.items()}
        self.reads = 0

    def __call__(self, pid: int) -> int:
        self.reads += 1
        values = self.script[pid]
        value = values.pop(0) if len(values) > 1 else values[0]
        return int(value * MB)


def test_peaks_per_service_and_of_the_sum_and_the_closing_reading() -> None:
    # The gateway peaks in the first reading, the worker in the second: the peak of the
    # sum (700 + 3000 = 3700) is less than the sum of the peaks (900 + 3000).
    reader = ScriptedReader({1: [900, 700, 650], 2: [2000, 3000, 2500]})
    sampler = ResidentSampler({"gateway": 1, "worker-0": 2}, read=reader)
    sampler.sample()
    sampler.sample()
    resident = sampler.finish()
    assert resident.peak_mb == {"gateway": 900.0, "worker-0": 3000.0}
    assert resident.end_mb == {"gateway": 650.0, "worker-0": 2500.0}
    assert resident.peak_total_mb == 3700.0
    assert resident.samples == 3


def test_a_gone_process_reads_zero_and_keeps_its_peak() -> None:
    reader = ScriptedReader({7: [120, 0]})
    sampler = ResidentSampler({"kvcache": 7}, read=reader)
    sampler.sample()
    resident = sampler.finish()
    assert resident.peak_mb == {"kvcache": 120.0} and resident.end_mb == {"kvcache": 0.0}


def test_the_thread_reads_until_finish_and_finish_reads_once_more() -> None:
    reader = ScriptedReader({1: [10, 20, 30]})
    sampler = ResidentSampler({"server": 1}, interval_s=3600.0, read=reader).start()
    resident = sampler.finish()       # the thread was still waiting out its first interval
    assert resident.samples == 2 and reader.reads == 2
    assert resident.peak_mb == {"server": 20.0} and resident.end_mb == {"server": 20.0}


def test_a_sampled_point_carries_its_services_memory() -> None:
    async def run_point() -> PointRun:
        return PointRun("concurrency", 1.0, [record(0.1, 0.5, 4)], [4], duration_s=1.0)

    served = Served("http://127.0.0.1:9", "m", {"this process": os.getpid()})
    run = asyncio.run(sampled(served, Plan(), run_point()))
    assert run.resident is not None and run.resident.samples >= 2
    assert run.resident.peak_mb["this process"] >= run.resident.end_mb["this process"] > 1


def test_point_json_and_table_show_resident_memory() -> None:
    run = PointRun("concurrency", 32.0, [record(0.1, 0.5, 4)], [4], duration_s=1.0)
    run.resident = Resident(peak_mb={"gateway": 612.4, "worker-0": 3080.0}, end_mb={"gateway": 600.0,
                            "worker-0": 3000.0}, peak_total_mb=3650.0, samples=5)
    p = point("fairserve", run, slo=Slo())
    assert p.resident_peak_mb == {"gateway": 612.4, "worker-0": 3080.0}
    assert to_json([p], {}, {})["points"][0]["resident_end_mb"] == {"gateway": 600.0, "worker-0": 3000.0}
    header, _, row = table([p], ["fairserve"]).splitlines()
    assert header.endswith("| peak resident MB | peak resident MB per service |")
    assert row.endswith("| 3,650 | gateway 612 · worker-0 3,080 |")
    unsampled = point("vllm", PointRun("rate", 1.0, [record(0.1, 0.5, 4)], [4], duration_s=1.0), slo=Slo())
    assert unsampled.resident_peak_total_mb is None
    assert table([unsampled], ["vllm"]).splitlines()[2].endswith("| — | — |")
    assert render_services({}) == "—"


def test_no_rates_leaves_the_poisson_points_out() -> None:
    plan = make_plan(parse_args(["--systems", "fairserve", "--concurrency", "32", "--no-rates"]))
    assert plan.concurrencies == (32,) and plan.rates == ()
    assert make_plan(parse_args([])).rates == Plan().rates
