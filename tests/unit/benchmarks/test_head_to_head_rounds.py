"""The head-to-head's rounds and peer settings: the alternating order, the median round per
point, the ratio lines, the best tuning, and each peer configured as its documentation
recommends (vLLM's threads bound to the allowed cores, llama-server's threads and slots)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from benchmarks.head_to_head.report import Point
from benchmarks.head_to_head.rounds import best_tuning, median_points, ratio_lines, round_order
from benchmarks.head_to_head.systems import LaunchConfig, allowed_cpus, cpu_list, llama_tunings, tunings, vllm_tunings


def at(system: str, x: float, tok_s: float, tpot_ms: float = 1.0) -> Point:
    return Point(system=system, kind="concurrency", x=x, sent=4, ok=4, duration_s=1.0, output_tokens_per_s=tok_s,
                 requests_per_s=4.0, goodput_per_s=4.0, ttft_p50_ms=1.0, ttft_p99_ms=1.0, tpot_p50_ms=tpot_ms,
                 tpot_p99_ms=1.0, mean_output_tokens=64.0, mean_prompt_tokens=274.0, wrong_length=0,
                 cached_prompt_fraction=0.0, errors=())


def config(concurrency: int = 32) -> LaunchConfig:
    return LaunchConfig(model_dir=Path("m"), log_dir=Path("l"), max_concurrency=concurrency)


def test_rounds_alternate_the_order() -> None:
    systems = ["fairserve", "vllm", "llama.cpp"]
    assert [round_order(systems, i) for i in range(3)] == [systems, systems[::-1], systems]


def test_each_point_is_its_median_round_with_every_round_kept() -> None:
    rounds = [[at("a", 32, 100.0), at("b", 32, 50.0)],
              [at("b", 32, 70.0), at("a", 32, 120.0)],
              [at("a", 32, 90.0), at("b", 32, 60.0)]]
    chosen = {p.system: p for p in median_points(rounds)}
    assert chosen["a"].output_tokens_per_s == 100.0 and chosen["a"].round_tokens_per_s == (100.0, 120.0, 90.0)
    assert chosen["b"].output_tokens_per_s == 60.0
    two = median_points([[at("a", 8, 10.0)], [at("a", 8, 20.0)]])
    assert two[0].output_tokens_per_s == 10.0          # the lower middle of an even count


def test_ratios_are_against_the_best_peer() -> None:
    points = [replace(at("fairserve", 32, 150.0), round_tokens_per_s=(150.0, 140.0, 160.0)),
              at("vllm", 32, 100.0), at("llama.cpp", 32, 75.0), at("vllm", 1, 10.0)]
    lines = ratio_lines(points)
    assert len(lines) == 1                              # concurrency 1 has no fairserve point
    assert lines[0].startswith("concurrency 32: fairserve 150.0 tok/s = 1.50x the best peer (vllm, 100.0)")
    assert "llama.cpp 2.00x" in lines[0] and "150.0/140.0/160.0" in lines[0]


def test_one_stream_s_tpot_is_given_against_each_peer_s() -> None:
    points = [at("fairserve", 1, 60.0, tpot_ms=8.68), at("vllm", 1, 19.0, tpot_ms=47.58),
              at("llama.cpp", 1, 42.5, tpot_ms=16.70)]
    line = ratio_lines(points)[0]
    assert "TPOT p50 8.68 ms = 0.18x vllm's 47.58, 0.52x llama.cpp's 16.70" in line
    assert "TPOT" not in ratio_lines([at("fairserve", 1, 60.0, tpot_ms=None), at("vllm", 1, 19.0)])[0]


def test_the_best_tuning_is_kept() -> None:
    assert best_tuning({"bound": 180.0, "auto": 95.0}) == "bound"
    assert best_tuning({"32 slots": 80.0, "8 slots": 80.0}) == "32 slots"


def test_cpu_lists_are_written_as_ranges() -> None:
    assert cpu_list([0, 1]) == "0-1"
    assert cpu_list([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert cpu_list([3]) == "3"


def test_vllm_is_first_configured_with_its_threads_bound_to_the_allowed_cores() -> None:
    recommended, default = vllm_tunings(config())
    assert recommended.env["VLLM_CPU_OMP_THREADS_BIND"] == cpu_list(allowed_cpus())
    assert int(recommended.env["VLLM_CPU_KVCACHE_SPACE"]) >= 2
    assert "VLLM_CPU_OMP_THREADS_BIND" not in default.env
    assert "VLLM_CPU_OMP_THREADS_BIND=" in recommended.describe()


def test_llama_server_gets_threads_slots_and_context_for_the_load() -> None:
    threads = str(len(allowed_cpus()))
    slots32, slots8 = llama_tunings(config(32))
    args = dict(zip(slots32.args[::2], slots32.args[1::2]))
    assert args == {"-t": threads, "-tb": threads, "-np": "32", "-c": str(32 * 2048)}
    assert dict(zip(slots8.args[::2], slots8.args[1::2]))["-np"] == "8"
    assert len(llama_tunings(config(4))) == 1           # no fewer slots to try than the load needs
    assert [t.name for t in tunings("fairserve", config())] == ["defaults"]
