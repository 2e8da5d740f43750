"""Multi-step decoding in the core (core/decode_steps.py) with the worker's runs
(services/worker/decode_steps.py) over the fake engine: the same tokens as one decode a
step, nothing past max_tokens, EOS or a stop token, fewer steps; quick runs take as many
as fit in DECODE_STEP_MS, fewer for a larger batch, none past decode_steps in a step
that prefills; no runs while a request
waits on the worker; an arrival's step reaches a worker whose steps in flight run several
decodes (one step deeper) instead of waiting behind them; and a worker lost with steps of runs
in flight costs its requests no token, lost or repeated."""

from __future__ import annotations

from dataclasses import replace

import pytest

from common.step import MAX_DECODE_STEPS
from services.scheduler.core.allowances.decode_steps import (multi_stepping, quick_runs, runs_allowance,
                                                             runs_until_slots_free)
from services.scheduler.core.types import CoreConfig, FinishReason
from services.worker.decode_steps import run_decode_steps

from tests.unit.scheduler.fake_worker import EOS_TOKEN_ID, FakeEngine, reference_output
from tests.unit.scheduler.harness import Harness


def _config(depth: int, **overrides: object) -> CoreConfig:
    values: dict[str, object] = dict(max_steps_in_flight=depth, prefill_chunk_size=8, max_batch_size=4,
                                     decode_steps=4)
    values.update(overrides)
    return CoreConfig(**values)  # type: ignore[arg-type]


def _running_the_runs(engine: FakeEngine) -> FakeEngine:
    """The engine as the worker's server drives it: each step's runs back to back."""
    one_run = engine.step
    engine.step = lambda plan: run_decode_steps(plan, one_run, {EOS_TOKEN_ID})  # type: ignore[method-assign]
    return engine


def test_the_allowance_is_bounded_by_max_tokens_and_blocks_and_is_never_zero() -> None:
    common = dict(num_computed=30, held_blocks=8, block_size=4)
    assert runs_allowance(decode_steps=4, drafts=0, outputs_left=100, spare_blocks=100, **common) == (4, 1, 0)
    assert runs_allowance(decode_steps=4, drafts=2, outputs_left=100, spare_blocks=100, **common) == (4, 3, 0)
    # 7 tokens left: a run brings at least one, so 4 runs, capped at 7 tokens (not 7 // 3 = 2 runs);
    # their slots still counted as if every draft were kept (30 + 4 * 3 = 42: 3 more blocks)
    assert runs_allowance(decode_steps=4, drafts=2, outputs_left=7, spare_blocks=100, **common) == (4, 3, 7)
    assert runs_allowance(decode_steps=8, drafts=2, outputs_left=3, spare_blocks=100, **common) == (3, 2, 3)
    assert runs_allowance(decode_steps=8, drafts=0, outputs_left=100, spare_blocks=1, **common) == (6, 1, 0)
    assert runs_allowance(decode_steps=8, drafts=0, outputs_left=1, spare_blocks=0, **common) == (1, 0, 0)
    assert multi_stepping(4, waiting=False) and not multi_stepping(4, waiting=True)
    assert not multi_stepping(1, waiting=False)
    assert runs_until_slots_free([9, 5, 12], waiting=1) == 5
    assert runs_until_slots_free([], waiting=3) == 1 and runs_until_slots_free([0], waiting=1) == 1
    batch = [1, 2] + [16] * 62       # two a token or two from their ends do not cut 64 to one run
    assert runs_until_slots_free(batch, waiting=64) == 16
    assert runs_until_slots_free([1, 2, 3] + [16] * 13, waiting=5) == 2     # an eighth of 16: two


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("num_blocks", [256, 30])    # 30: preemptions and recomputes
@pytest.mark.parametrize("drafts", [0, 2])
@pytest.mark.parametrize("prefill_runs", [1, 4])
def test_runs_stream_the_reference_tokens_up_to_max_tokens(depth: int, num_blocks: int, drafts: int,
                                                          prefill_runs: int) -> None:
    engine = _running_the_runs(FakeEngine(num_blocks=num_blocks, accepted_drafts=drafts))
    h = Harness(_config(depth, speculative_tokens=drafts, prefill_decode_steps=prefill_runs), engine)
    prompts = {}
    for n in range(6):
        prompt = tuple(range(20 + 3 * n, 25 + 7 * n))
        prompts[h.submit(prompt, max_tokens=3 + 5 * n, priority=n % 3).request_id] = (prompt, 3 + 5 * n)
    h.run()
    for rid, (prompt, max_tokens) in prompts.items():
        stream = h.streams[rid]
        assert stream.finish is not None and stream.finish.reason is FinishReason.LENGTH
        assert stream.token_ids == reference_output(prompt, max_tokens)
        assert stream.finish.usage.completion_tokens == max_tokens
    assert any(item.decode_steps > 1 for plan in h.plans["w0"] for item in plan.work)
    engine.check_invariants()
    assert not engine.seqs and engine.pool().used_blocks == 0


@pytest.mark.parametrize("accepted, runs, caps", [(0, [4, 4, 3], [11, 7, 3]), (2, [4], [11])])
def test_drafts_near_max_tokens_do_not_cut_the_runs_the_cap_ends_them(accepted: int, runs: list[int],
                                                                     caps: list[int]) -> None:
    # Two drafts a run, 4 runs a step, 11 tokens to go after the prefill's. Counted at 3 tokens a
    # run against max_tokens, the runs would be 3, 2, 2, 1, 1, 1 (no draft kept): each run brings
    # at least one token, so they are 4, 4, 3, the items capped at the tokens left and the worker
    # ending the runs there (all drafts kept: 3 + 3 + 3 + 2, the last run's drafts trimmed).
    h = Harness(_config(1, speculative_tokens=2), _running_the_runs(FakeEngine(accepted_drafts=accepted)))
    prompt = tuple(range(30, 38))
    rid = h.submit(prompt, max_tokens=12).request_id
    h.run()
    assert h.streams[rid].token_ids == reference_output(prompt, 12)
    decodes = [item for plan in h.plans["w0"] for item in plan.work if item.num_tokens == 1]
    assert [item.decode_steps for item in decodes] == runs
    assert [item.max_outputs for item in decodes] == caps
    assert all(item.extra_tokens + 1 == item.max_outputs for item in decodes)


def test_quick_runs_fit_the_budget_scaled_with_the_decodes() -> None:
    assert quick_runs(160.0, 11.0, 1, 1) == 14          # 4 runs of one decode took 44 ms
    assert quick_runs(160.0, 11.0, 1, 2) == 7           # two decodes: a run counted twice as long
    assert quick_runs(160.0, 11.0, 4, 2) == 14          # fewer decodes than measured: no quicker
    assert quick_runs(160.0, 88.0, 8, 8) == 1           # the caller keeps decode_steps at least
    assert quick_runs(160.0, 0.5, 1, 1) == MAX_DECODE_STEPS
    assert quick_runs(0.0, 11.0, 1, 1) == 0 and quick_runs(160.0, 0.0, 0, 1) == 0


def _timed_runs(engine: FakeEngine) -> FakeEngine:
    """The worker's runs over a fake engine whose run takes 1 ms a decode."""
    one_run = engine.step
    engine.step = lambda plan: replace(one_run(plan), forward_ms=float(len(plan.work)))  # type: ignore[method-assign]
    return _running_the_runs(engine)


def _most_runs(h: Harness) -> int:
    return max(item.decode_steps for plan in h.plans["w0"] for item in plan.work)


def test_quick_runs_take_more_runs_a_step_within_the_budget_and_the_same_tokens() -> None:
    # A run takes 1 ms a decode: 8 ms fit 8 runs of one decode, 4 of two.
    streams = []
    for decodes, budget, most in ((1, 0.0, 2), (1, 8.0, 8), (2, 8.0, 4)):
        h = Harness(_config(2, decode_steps=2, decode_step_ms=budget), _timed_runs(FakeEngine()))
        prompts = [tuple(range(10 + 20 * n, 18 + 20 * n)) for n in range(decodes)]
        for prompt in prompts:
            h.submit(prompt, max_tokens=60)
        h.run()
        assert _most_runs(h) == most
        # Quick runs carry their budget for the worker to keep; without them no step has one.
        bounds = {plan.runs_ms for plan in h.plans["w0"] if any(i.decode_steps > 2 for i in plan.work)}
        assert bounds == ({budget} if budget else set())
        assert budget or all(plan.runs_ms == 0 for plan in h.plans["w0"])
        assert [h.streams[rid].token_ids for rid in h.streams] == [reference_output(p, 60) for p in prompts]
        streams.append(h.steps)
    assert streams[1] < streams[0]


def test_quick_runs_leave_a_step_that_prefills_at_its_prefill_runs() -> None:
    h = Harness(_config(2, decode_steps=2, decode_step_ms=8.0), _timed_runs(FakeEngine()))
    first = h.submit(range(10, 18), max_tokens=200).request_id
    for _ in range(6):
        h.step()
    assert h.plans["w0"][-1].work[0].decode_steps == 8
    h.submit(range(40, 48), max_tokens=200)
    h.step()
    step = h.plans["w0"][-1]
    assert step.new_sequences and all(item.decode_steps == 1 for item in step.work)
    for _ in range(4):
        h.step()
    runs = [item.decode_steps for item in h.plans["w0"][-1].work]
    assert len(runs) == 2 and max(runs) == 4      # the one-decode run's time, counted twice
    assert any(item.seq_id.startswith(first) for item in h.plans["w0"][-1].work)


def test_a_tenant_s_quick_runs_do_not_hold_back_another_tenant_s_arrival() -> None:
    # One tenant's lone stream on a quick worker: steps of 16 runs in flight. Another tenant's
    # request arriving is planned at once, one step deeper, and the worker ends the runs after
    # the one in progress (tests/unit/worker/test_decode_steps_interrupt.py).
    h = Harness(_config(2, decode_step_ms=16.0), _timed_runs(FakeEngine(num_blocks=256)))
    h.submit(range(10, 18), max_tokens=200, client_id="alice")
    for _ in range(4):
        h.step()
    core = h.core
    while len(h.sent["w0"]) < 2:
        h.sent["w0"].append(core.plan_step("w0"))
    assert [item.decode_steps for step in h.sent["w0"] for item in step.work] == [16, 16]
    arrival = h.submit(range(40, 48), max_tokens=8, client_id="bob").request_id
    assert core.step_depth("w0") == 3
    third = core.plan_step("w0")
    assert third is not None and third.new_sequences[0].seq_id.startswith(arrival)
    assert all(item.decode_steps == 1 for item in third.work)


def test_a_lone_request_takes_fewer_steps_than_tokens() -> None:
    single, multi = Harness(_config(2, decode_steps=1), FakeEngine()), \
        Harness(_config(2), _running_the_runs(FakeEngine()))
    for h in (single, multi):
        h.submit(range(10, 18), max_tokens=40)
        h.run()
    assert [s.token_ids for s in multi.streams.values()] == [s.token_ids for s in single.streams.values()]
    assert multi.steps * 2 < single.steps


def test_no_token_past_eos_or_a_stop_token_within_a_step() -> None:
    def next_token(tokens):   # 7, 8, 9, ... then EOS as the tenth output token
        return EOS_TOKEN_ID if len(tokens) == 8 + 9 else 7 + len(tokens) - 8
    engine = _running_the_runs(FakeEngine(next_token=next_token))
    h = Harness(_config(2), engine)
    eos = h.submit(range(10, 18), max_tokens=40).request_id
    stop = h.submit(range(30, 38), max_tokens=40, stop_token_ids=frozenset({11})).request_id
    h.run()
    assert h.streams[eos].token_ids == [*range(7, 16), EOS_TOKEN_ID]
    assert h.streams[eos].finish.reason is FinishReason.STOP
    assert h.streams[stop].token_ids == [7, 8, 9, 10, 11]
    assert h.streams[stop].finish.reason is FinishReason.STOP
    assert not engine.seqs


def test_no_runs_while_a_request_waits_on_the_worker() -> None:
    engine = _running_the_runs(FakeEngine())
    h = Harness(_config(1), engine)
    first = h.submit(range(10, 18), max_tokens=200).request_id
    for _ in range(4):
        h.step()
    assert h.plans["w0"][-1].work[0].decode_steps == 4
    h.submit(range(40, 48), max_tokens=8)       # queued on the worker: its prefill goes next
    h.step()
    step = h.plans["w0"][-1]
    assert step.new_sequences and all(item.decode_steps == 1 for item in step.work)
    assert any(item.seq_id.startswith(first) for item in step.work)


def test_an_arrival_behind_runs_in_flight_is_planned_at_once_one_step_deeper() -> None:
    engine = _running_the_runs(FakeEngine())
    h = Harness(_config(2), engine)
    h.submit(range(10, 18), max_tokens=200)
    for _ in range(4):
        h.step()
    core = h.core
    while len(h.sent["w0"]) < 2:                  # both step slots taken by runs of decodes
        h.sent["w0"].append(core.plan_step("w0"))
    assert all(item.decode_steps > 1 for step in h.sent["w0"] for item in step.work)
    assert core.step_depth("w0") == 2
    arrival = h.submit(range(40, 48), max_tokens=8).request_id
    assert core.step_depth("w0") == 3
    third = core.plan_step("w0")
    assert third is not None and [new.seq_id for new in third.new_sequences][0].startswith(arrival)
    assert third.after_step_id == h.sent["w0"][-1].step_id
    with pytest.raises(RuntimeError):
        core.plan_step("w0")


def test_a_worker_lost_with_runs_in_flight_resumes_its_requests_elsewhere_exactly() -> None:
    engines = {"w0": _running_the_runs(FakeEngine()), "w1": _running_the_runs(FakeEngine())}
    h = Harness(_config(2), engines)
    moved = h.submit(range(10, 18), max_tokens=60, hints={"w1": 8}).request_id
    stays = h.submit(range(30, 38), max_tokens=60, hints={"w0": 8}).request_id
    assert h.core.worker_of(moved) == "w1"
    for _ in range(4):
        h.step()
    while len(h.sent["w1"]) < 2 and (step := h.core.plan_step("w1")) is not None:
        h.sent["w1"].append(step)          # both step slots hold runs when it dies
    assert any(item.decode_steps > 1 for step in h.sent["w1"] for item in step.work)
    streamed = len(h.streams[moved].token_ids)
    assert 0 < streamed < 60
    h.engines.pop("w1")          # gone with its steps of runs in flight
    h.deliver(h.core.remove_worker("w1", "w1 crashed"))
    assert h.core.worker_of(moved) == "w0"
    h.run()
    assert h.streams[moved].token_ids == reference_output(range(10, 18), 60)
    assert h.streams[stays].token_ids == reference_output(range(30, 38), 60)
    assert h.core.stats().migrations == 1


def _full_batch_and_a_queue(priorities: tuple[int, int], tenants: tuple[str, str] = ("", ""),
                            **config: object) -> tuple[Harness, str]:
    """Four running requests (the batch is four) that have decoded with runs; then a fifth
    queued on the worker. Returns the harness and its id."""
    h = Harness(_config(1, decode_steps=16, **config), _running_the_runs(FakeEngine()))
    keyed = dict(authenticated=True) if tenants[0] else {}
    for n in range(4):
        h.submit(range(10 + 10 * n, 18 + 10 * n), max_tokens=30 + 7 * n, priority=priorities[0],
                 client_id=tenants[0], **keyed)
    for _ in range(2):         # the four prefill, then decode
        h.step()
    assert min(item.decode_steps for item in h.plans["w0"][-1].work) > 1
    assert len(h.core._workers["w0"].active) == 4
    queued = h.submit(range(90, 98), max_tokens=8, priority=priorities[1], client_id=tenants[1], **keyed).request_id
    return h, queued


def test_requests_queued_behind_a_full_batch_keep_the_runs_until_a_slot_frees() -> None:
    h, queued = _full_batch_and_a_queue((0, 0))
    worker = h.core._workers["w0"]
    left = min(r.max_tokens - len(r.output) for r in worker.active)
    h.step()
    step = h.plans["w0"][-1]
    assert not step.new_sequences and {item.decode_steps for item in step.work} == {left}
    assert left > 1
    h.step()                   # the first to finish freed its slot: the queued one goes in
    assert [new.seq_id for new in h.plans["w0"][-1].new_sequences][0].startswith(queued)
    h.run()
    assert all(stream.finish is not None and stream.finish.reason is FinishReason.LENGTH
               for stream in h.streams.values())


@pytest.mark.parametrize("case", ["priority", "tenant"])
def test_a_queued_request_that_would_take_a_slot_stops_the_runs(case: str) -> None:
    """A higher priority, or (the attack) another tenant while one tenant holds the whole batch
    with long generations: slot fairness hands it a slot now, so it waits out no runs."""
    h, queued = (_full_batch_and_a_queue((0, 5)) if case == "priority"
                 else _full_batch_and_a_queue((0, 0), ("hog", "victim")))
    h.step()
    step = h.plans["w0"][-1]
    assert [new.seq_id for new in step.new_sequences][0].startswith(queued)
    assert all(item.decode_steps == 1 for item in step.work)


def test_with_prefill_runs_an_arrival_decodes_on_in_its_prefill_step() -> None:
    engine = _running_the_runs(FakeEngine())
    h = Harness(_config(1, prefill_decode_steps=4), engine)
    first = h.submit(range(10, 18), max_tokens=200).request_id
    for _ in range(4):
        h.step()
    arrival = h.submit(range(40, 48), max_tokens=8).request_id
    h.step()
    step = h.plans["w0"][-1]
    assert [new.seq_id for new in step.new_sequences][0].startswith(arrival)
    assert {item.decode_steps for item in step.work} == {4}    # the chunk that ends its prompt too
    assert len(h.streams[arrival].token_ids) == 4
    h.run()
    assert h.streams[arrival].token_ids == reference_output(tuple(range(40, 48)), 8)
    assert h.streams[first].token_ids == reference_output(tuple(range(10, 18)), 200)


def test_with_prefill_runs_a_prompt_with_chunks_left_keeps_the_runs_off() -> None:
    h = Harness(_config(1, prefill_decode_steps=4), _running_the_runs(FakeEngine()))
    h.submit(range(10, 18), max_tokens=200)
    for _ in range(4):
        h.step()
    h.submit(range(100, 120), max_tokens=8)      # 20 tokens: chunks of 8, two left after the first
    h.step()
    assert all(item.decode_steps == 1 for item in h.plans["w0"][-1].work)
