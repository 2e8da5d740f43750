"""The step profile's pure parts: exclusive time per category from nested timers on a
fake clock, the step kinds, the tables, and the served run's histogram arithmetic."""

from __future__ import annotations

import pytest

from benchmarks.step_profile.clock import StepClock
from benchmarks.step_profile.gemm_peak import ReferenceGemms
from benchmarks.step_profile.instrument import GEMMS, classify
from benchmarks.step_profile.report import Peak, kind_table, run_table
from benchmarks.step_profile.served import ServedSteps, read_histogram
from common.step import StepBatch, WorkItem


class FakeTime:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def profiled_step(clock: StepClock, time: FakeTime, rows: int):
    """A step of 10 s: 1 s of its own, a 6 s forward holding a 4 s GEMM of rows x 8 -> 16."""
    def gemm(x: int) -> None:
        time.now += 4.0

    timed_gemm = clock.timed(GEMMS, gemm, flops=lambda x: 2.0 * x * 8 * 16)

    def forward() -> None:
        time.now += 2.0
        timed_gemm(rows)

    timed_forward = clock.timed("forward glue", forward)

    def step(batch: StepBatch) -> None:
        time.now += 1.0
        timed_forward()
        time.now += 3.0

    return clock.step("engine Python", step, classify)


def test_nested_timers_count_each_instant_once_in_the_innermost_call() -> None:
    time = FakeTime()
    clock = StepClock(now=time)
    step = profiled_step(clock, time, rows=100)
    step(StepBatch(work=[WorkItem("a", 100), WorkItem("b", 1)]))
    step(StepBatch(work=[WorkItem("a", 1), WorkItem("b", 1)]))
    assert clock.kinds() == ["prefill", "decode"]
    assert clock.seconds[("prefill", GEMMS)] == 4.0
    assert clock.seconds[("prefill", "forward glue")] == 2.0
    assert clock.seconds[("prefill", "engine Python")] == 4.0
    assert sum(v for (kind, _), v in clock.seconds.items() if kind == "decode") == clock.step_seconds["decode"] == 10
    assert clock.flops[("prefill", GEMMS)] == 2.0 * 100 * 8 * 16
    assert (clock.step_rows["prefill"], clock.step_rows["decode"]) == (101, 2)
    clock.reset()
    assert clock.kinds() == [] and not clock.seconds


def test_work_after_each_step_is_kept_out_of_the_steps_and_counted_apart() -> None:
    time = FakeTime()
    clock = StepClock(now=time)
    seen = []

    def after(kind: str, rows: int) -> None:
        seen.append((kind, rows))
        time.now += 5.0

    clock.after_step = after
    profiled_step(clock, time, rows=3)(StepBatch(work=[WorkItem("a", 3)]))
    assert seen == [("prefill", 3)]
    assert clock.step_seconds["prefill"] == 10.0 and clock.excluded_s == 5.0
    clock.reset()
    assert clock.excluded_s == 0.0


def test_reference_gemms_count_each_samples_flops_and_rows() -> None:
    reference = ReferenceGemms([(8, 16), (16, 8)], kernel="plain")
    reference.sample("decode", 4)
    reference.sample("decode", 6)
    assert reference.samples["decode"] == 2 and reference.rows["decode"] == 10
    assert reference.flops["decode"] == 2.0 * 10 * (8 * 16 + 16 * 8)
    assert reference.rate("decode") > 0 and reference.rate("prefill") is None
    reference.reset()
    assert reference.rate("decode") is None and reference.spent_s == 0.0


def test_a_raising_call_still_counts_and_leaves_the_stack_balanced() -> None:
    time = FakeTime()
    clock = StepClock(now=time)

    def fails() -> None:
        time.now += 2.0
        raise ValueError("boom")

    with pytest.raises(ValueError):
        clock.timed("attention", fails)()
    assert clock.seconds[("decode", "attention")] == 2.0
    time.now = 10.0
    clock.timed("norms", lambda: None)()
    assert clock.seconds[("decode", "norms")] == 0.0


def test_speculative_rows_count_and_a_decode_with_drafts_is_not_a_prefill() -> None:
    assert classify(StepBatch(work=[WorkItem("a", 1, 3), WorkItem("b", 1)])) == ("decode", 5)
    assert classify(StepBatch(work=[WorkItem("a", 7)])) == ("prefill", 7)


def test_tables_show_time_per_step_shares_and_the_gemm_rate_against_the_peak() -> None:
    time = FakeTime()
    clock = StepClock(now=time)
    step = profiled_step(clock, time, rows=1_000_000)
    step(StepBatch(work=[WorkItem("a", 500)]))
    step(StepBatch(work=[WorkItem("a", 500)]))
    text = kind_table(clock, "prefill", Peak("oneDNN", 500, 0.016))
    assert "2 steps, 500 rows (tokens) per step, 10,000.0 ms per step" in text
    # 256 MFLOP per GEMM call in 4 s: 0.064 GFLOP/s, 400 % of a 0.016 "peak".
    assert "| layer GEMMs | 4,000.00 | 40.0% | 0 | 400% of 0 (oneDNN alone, 500 rows) |" in text
    assert "| forward glue | 2,000.00 | 20.0% |  |  |" in text
    whole = run_table(clock, wall_s=25.0)
    assert "| engine Python | 8.00 | 32.0% |" in whole
    assert "| driver between steps (the scheduler's stand-in) | 5.00 | 20.0% |" in whole


METRICS = """# HELP fairserve_worker_step_seconds Forward time per step
# TYPE fairserve_worker_step_seconds histogram
fairserve_worker_step_seconds_bucket{le="0.1",worker="worker-0"} 3.0
fairserve_worker_step_seconds_bucket{le="+Inf",worker="worker-0"} 4.0
fairserve_worker_step_seconds_count{worker="worker-0"} 4.0
fairserve_worker_step_seconds_sum{worker="worker-0"} 0.5
"""


def test_histogram_count_and_sum_from_a_metrics_page() -> None:
    found = read_histogram(METRICS, "fairserve_worker_step_seconds")
    assert (found.count, found.total_s) == (4.0, 0.5)
    assert read_histogram(METRICS, "fairserve_other").count == 0


def test_the_served_wait_is_the_wall_time_less_the_engine_time() -> None:
    steps = ServedSteps(wall_s=10.0, steps=100, forward_s=7.0, rpc_s=9.5, tokens=2048)
    text = steps.table(engine_outside_forward_ms=10.0)       # 100 steps x 10 ms = 1 s
    assert "| engine forward + sampling (worker histogram) | 7.00 | 70.0 | 70.0% |" in text
    assert "| worker waits for its next step (the rest) | 2.00 | 20.0 | 20.0% |" in text
    assert "204.8 tokens/s" in text


def test_the_cpu_table_shares_the_cores_wall_time() -> None:
    steps = ServedSteps(wall_s=10.0, steps=100, forward_s=7.0, rpc_s=9.5, tokens=2048,
                        cpu_s={"worker-0": 16.0, "gateway": 1.5, "client": 0.5})
    text = steps.cpu_table(cores=2)                          # 20 CPU s in all
    assert "| worker-0 | 16.00 | 80.0% |" in text
    assert "| gateway | 1.50 | 7.5% |" in text
    assert "| (none of these) | 2.00 | 10.0% |" in text
    assert "CPU time during the run" in steps.table(engine_outside_forward_ms=10.0)
