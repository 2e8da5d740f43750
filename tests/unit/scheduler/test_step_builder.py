"""A step under construction: budgets taken and given back exactly."""

from __future__ import annotations

from common.types import SamplingParams

from services.scheduler.core.step_builder import StepBuilder
from common.step import NewSequence, WorkItem


def test_add_and_drop_move_the_budgets_by_tokens_drafts_and_blocks() -> None:
    plan = StepBuilder(step_id=7, available_blocks=10, token_budget=100, frees=[])
    plan.add("a", 30, 8, is_decode=False)
    plan.add("b", 1, 1, is_decode=True, drafts=3)
    assert (plan.token_budget, plan.available_blocks) == (66, 1)
    assert plan.planned_blocks("a") == 8 and plan.planned_blocks("zzz") == 0
    plan.drop("b")
    assert (plan.token_budget, plan.available_blocks) == (70, 2)
    plan.drop("b")      # dropping twice gives nothing back twice
    assert (plan.token_budget, plan.available_blocks) == (70, 2)
    assert plan.has_prefill and not plan.has_decode


def test_freeing_a_sequence_drops_its_work_and_returns_the_blocks_it_held() -> None:
    frees = ["old"]
    plan = StepBuilder(step_id=1, available_blocks=10, token_budget=100, frees=frees)
    plan.add("a", 4, 2, is_decode=False)
    plan.free("a", blocks_held=5)
    assert (plan.token_budget, plan.available_blocks, frees) == (100, 15, ["old", "a"])
    assert not plan.has_work


def test_build_sends_the_work_in_order_or_nothing() -> None:
    assert StepBuilder(step_id=1, available_blocks=1, token_budget=1, frees=[]).build() is None
    plan = StepBuilder(step_id=3, available_blocks=10, token_budget=100, frees=["gone"])
    new = NewSequence(seq_id="a", prompt_token_ids=(1, 2), output_token_ids=(), sampling=SamplingParams())
    plan.new_sequences.append(new)
    plan.add("a", 2, 1, is_decode=False)
    plan.add("b", 1, 0, is_decode=True, drafts=2)
    step = plan.build(after_step_id=2)
    assert step is not None
    assert (step.step_id, step.after_step_id, step.free_seq_ids, step.new_sequences) == (3, 2, ("gone",), (new,))
    assert [(item.seq_id, item.num_tokens, item.draft_tokens) for item in step.work] == \
        [("a", 2, 0), ("b", 1, 2)]
    frees_only = StepBuilder(step_id=4, available_blocks=0, token_budget=0, frees=["x"]).build()
    assert frees_only is not None and frees_only.free_seq_ids == ("x",) and not frees_only.work
