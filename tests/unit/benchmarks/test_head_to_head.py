"""The head-to-head benchmark's pure parts: prompts, per-system request fields,
the numbers per point (goodput, wrong lengths), the table, finding peers."""

from __future__ import annotations

from dataclasses import replace

import json
from pathlib import Path

from benchmarks.head_to_head import peers
from benchmarks.head_to_head.report import Slo, point, problems, table
from benchmarks.head_to_head.sweep import Plan, PointRun
from benchmarks.head_to_head.systems import greedy_fields
from benchmarks.head_to_head.workload import ChatMix, chat_prompt, unique_requests
from loadsim.transport import OK, STREAM_ERROR, RequestRecord


def record(ttft: float, latency: float, tokens: int, outcome: str = OK, error: str = "") -> RequestRecord:
    return RequestRecord(user="u", user_class="c", template="t", started_s=0.0, outcome=outcome, error=error,
                         ttft_s=ttft, latency_s=latency, completion_tokens=tokens, prompt_tokens=10,
                         chunk_times_s=[ttft, latency])


def test_unique_prompts_start_differently_and_repeat_per_seed() -> None:
    requests = unique_requests(40, 64, seed=3)
    assert len({r.prompt[:8] for r in requests}) == 40
    assert all(r.max_tokens == 64 for r in requests)
    assert requests == unique_requests(40, 64, seed=3)
    assert requests != unique_requests(40, 64, seed=4)
    assert all(len(r.prompt) < 200 for r in unique_requests(5, 8, seed=0, short=True))


def test_chat_mix_shares_system_texts_and_carries_the_replies() -> None:
    conversations = [ChatMix(seed=1, max_turns=3).conversation() for _ in range(1)]
    mix = ChatMix(seed=1, max_turns=3)
    drawn = [mix.conversation() for _ in range(20)]
    assert drawn[0] == conversations[0]
    assert len({c.system for c in drawn}) < len(drawn)          # conversations share their system text
    assert {len(c.questions) for c in drawn} <= {1, 2, 3}
    prompt = chat_prompt("SYS", [("Hi?", " Hello.")], "Why?")
    assert prompt == "SYS\n\nUser: Hi?\nAssistant: Hello.\nUser: Why?\nAssistant:"


def test_every_system_is_asked_for_exactly_max_tokens() -> None:
    for system in ("fairserve", "vllm", "llama.cpp"):
        assert greedy_fields(system, 64) == {"ignore_eos": True}
    config = json.loads(greedy_fields("transformers", 64)["generation_config"])
    assert config == {"max_new_tokens": 64, "do_sample": False}


def test_point_counts_goodput_within_both_slos_and_wrong_lengths() -> None:
    run = PointRun("rate", 2.0, duration_s=10.0)
    run.records = [record(0.5, 0.5 + 9 * 0.1, 10),        # TTFT 0.5 s, TPOT 0.1 s: good
                   record(4.0, 4.0 + 9 * 0.1, 10),        # TTFT too long
                   record(0.5, 0.5 + 9 * 0.5, 10),        # TPOT too long
                   record(0.5, 1.0, 6),                   # good but short of its 10 tokens
                   record(0.5, 1.0, 0, outcome=STREAM_ERROR, error="cut")]
    run.expected_tokens = [10, 10, 10, 10, 10]
    p = point("fairserve", run, Slo(ttft_s=3.0, tpot_s=0.25))
    assert (p.sent, p.ok, p.wrong_length) == (5, 4, 1)
    assert p.goodput_per_s == 0.2 and p.requests_per_s == 0.4
    assert p.output_tokens_per_s == 3.6
    assert p.errors == ("1x stream_error: cut",)
    assert any("1 of 4 answers were not max_tokens long" in line for line in problems([p]))
    rows = table([p], ["fairserve"]).splitlines()
    assert rows[2].startswith("| 2 req/s | fairserve | 4 / 5 | 3.6 | 0.20 |")
    assert "(1 off)" in rows[2]


def test_a_short_tpot_keeps_two_decimals_in_the_table() -> None:
    run = PointRun("concurrency", 1.0, duration_s=1.0)
    run.records = [record(0.4, 0.4 + 9 * 0.00868, 10)]
    run.expected_tokens = [10]
    quick = point("fairserve", run, Slo())
    assert "| 8.68 | 8.68 |" in table([quick], ["fairserve"])
    slow = replace(quick, tpot_p50_ms=144.6, tpot_p99_ms=None)
    assert "| 145 | — |" in table([slow], ["fairserve"])


def test_plan_sends_at_least_min_requests() -> None:
    plan = Plan(requests_per_slot=2, min_requests=6)
    assert [plan.closed_count(c) for c in (1, 8, 32)] == [6, 16, 64]
    assert [Plan(requests_per_slot=1.5, min_requests=4).closed_count(c) for c in (1, 8, 32)] == [4, 12, 48]


def test_peers_not_set_up_say_why(tmp_path: Path) -> None:
    found = peers.find_peers(tmp_path)
    assert found["vllm"].executable is None and "make bench-peers" in found["vllm"].reason
    assert found["llama.cpp"].executable is None and "make bench-peers" in found["llama.cpp"].reason
    server = peers.llama_server_executable(tmp_path)
    server.parent.mkdir(parents=True)
    server.write_text("")
    assert "no GGUF" in peers.find_peers(tmp_path)["llama.cpp"].reason


def test_a_request_past_the_points_time_limit_is_cut_and_counted() -> None:
    import asyncio

    from benchmarks.head_to_head.sweep import Driver
    from benchmarks.head_to_head.systems import Served

    class Slow:
        async def send(self, request, started_s):
            await asyncio.sleep(10)

        async def close(self) -> None:
            pass

    driver = Driver("fairserve", Served("http://127.0.0.1:9", "m"), Plan(point_cap_s=0.05, drain_s=0.05))
    driver._transport = Slow()
    run = asyncio.run(driver.closed(2, unique_requests(4, 8, seed=0)))
    assert len(run.records) == 2 and run.duration_s < 1.0
    assert all(r.outcome == "transport_error" and "time limit" in r.error for r in run.records)


def test_a_dtype_reaches_every_system_as_its_own_setting(tmp_path) -> None:
    from benchmarks.head_to_head.__main__ import launch_config, make_plan, parse_args
    from benchmarks.head_to_head.systems import fairserve_dtype_env

    args = parse_args(["--dtype", "bfloat16", "--systems", "fairserve"])
    config = launch_config("fairserve", args, tmp_path, tmp_path / "logs", make_plan(args), {})
    assert config.dtype == "bfloat16"
    assert fairserve_dtype_env("bfloat16") == {"CPU_COMPUTE": "bfloat16"}
    assert fairserve_dtype_env("float32") == {}      # the default: no setting at all
    assert parse_args([]).dtype == "float32"
