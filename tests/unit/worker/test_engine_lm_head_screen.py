"""The engine with its LM head screen on: the same tokens as with the full head (and as
transformers' generate), for every kind of row the screen serves or passes over."""

from __future__ import annotations

import pytest
import torch

from common.types import SamplingParams
from services.worker.engine.config import EngineConfig
from common.step import NewSequence, StepBatch, StepOutput, WorkItem
from services.worker.engine.cpu.screen import screen_loader
from services.worker.engine.cpu.screen.lm_head_screen import LMHeadScreen
from services.worker.engine.cpu.screen.screen_fbgemm import screening_available
from services.worker.engine.cpu.screen.screen_loader import MIN_SCREENED_VOCAB
from services.worker.wiring import build_engine
from tests.fixtures.tiny_model import build_model, gemma3_config, llama_config
from tests.unit.worker.engine_helpers import Driver, assert_greedy_matches, make_engine, prompt_of, reference_model
from tests.unit.worker.test_engine_speculation import repetitive_prompt



def screened_rows(driver: Driver) -> tuple[int, int]:
    return sum(s.screened_rows for s in driver.steps), sum(s.full_rows for s in driver.steps)


@pytest.mark.parametrize("kind", ["gemma3", "llama", "gemma4"])
def test_greedy_with_the_screen_equals_generate(kind: str) -> None:
    prompts = {"a": prompt_of(5), "b": prompt_of(13, salt=1), "c": prompt_of(21, salt=2)}
    engine = make_engine(kind, lm_head_screen="on")
    assert engine.lm_head_screened
    driver = Driver(engine)
    got = driver.run(prompts, 12, chunk={"c": 6})         # mixed lengths, one prompt in chunks
    assert_greedy_matches(reference_model(kind), prompts, got, 12)
    screened, full = screened_rows(driver)
    assert screened > 0 and full == 0


@pytest.mark.skipif(not screening_available(), reason="no fbgemm int8 kernel on this CPU")
def test_without_the_c_kernel_fbgemm_screens_the_same_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(screen_loader, "load_native_matmul", lambda cache_dir: None)
    prompts = {"a": prompt_of(5), "b": prompt_of(17, salt=1)}
    engine = make_engine("gemma3", lm_head_screen="on")
    screen = engine.prepared.screen.screen
    assert screen is not None and screen.kernel == "fbgemm"
    driver = Driver(engine)
    assert_greedy_matches(reference_model("gemma3"), prompts, driver.run(prompts, 10), 10)
    assert screened_rows(driver)[0] > 0


def test_the_screen_uses_the_c_kernel_where_it_builds() -> None:
    loader = make_engine("llama", lm_head_screen="on").prepared.screen
    assert loader.screen is not None and loader.screen.kernel == "native"
    assert loader.max_rows(loader.screen) == screen_loader.DEFAULT_SCREEN_MAX_ROWS["native"]


@pytest.mark.skipif(not screening_available(), reason="no fbgemm int8 kernel on this CPU")
def test_with_the_c_kernels_off_the_screen_uses_fbgemm() -> None:
    screen = make_engine("llama", lm_head_screen="on", cpu_native_kernels="off").prepared.screen.screen
    assert screen is not None and screen.kernel == "fbgemm"


def test_every_sampling_kind_gives_the_tokens_of_the_full_head() -> None:
    prompts = {name: prompt_of(9 + i, salt=i) for i, name in enumerate("abcdefgh")}
    sampling = {"a": SamplingParams(),
                "b": SamplingParams(temperature=0.7, top_k=20, seed=5),
                "c": SamplingParams(temperature=0.9, seed=6),                       # needs the whole row
                "d": SamplingParams(repetition_penalty=1.3, presence_penalty=0.4, min_tokens=6),
                "e": SamplingParams(logprobs=True, top_logprobs=2),                 # needs the whole row
                "f": SamplingParams(temperature=1.1, top_k=64, top_p=0.8, min_p=0.02, seed=9),
                "g": SamplingParams(logit_bias=((3, 100.0), (7, -100.0), (11, 2.5))),
                "h": SamplingParams(temperature=0.8, top_k=8, seed=3, logit_bias=((5, 4.0),))}
    full = Driver(make_engine("gemma3", lm_head_screen="off"))
    expected = full.run(prompts, 10, sampling=sampling)
    screened = Driver(make_engine("gemma3", lm_head_screen="on"))
    assert screened.run(prompts, 10, sampling=sampling) == expected
    rows, full_rows = screened_rows(screened)
    assert rows > 0 and full_rows > 0
    assert screened_rows(full) == (0, sum(s.full_rows for s in full.steps))


def test_more_rows_than_the_limit_take_the_full_head() -> None:
    prompts = {f"s{i}": prompt_of(6, salt=i) for i in range(4)}
    driver = Driver(make_engine("gemma3", lm_head_screen="on", lm_head_screen_max_rows=3))
    got = driver.run(prompts, 6)
    assert_greedy_matches(reference_model("gemma3"), prompts, got, 6)
    assert all(step.screened_rows == 0 for step in driver.steps if step.full_rows >= 4)
    assert any(step.full_rows == 4 for step in driver.steps)


def test_speculative_rows_are_screened_and_greedy_still_equals_generate() -> None:
    prompts = {"a": repetitive_prompt(6, 4), "b": repetitive_prompt(5, 5, salt=1)}
    driver = Driver(make_engine("gemma3", lm_head_screen="on"))
    got = driver.run(prompts, 20, draft_tokens=3)
    assert_greedy_matches(reference_model("gemma3"), prompts, got, 20)
    assert sum(step.accepted_tokens for step in driver.steps) > 0
    assert screened_rows(driver)[0] > 0


def test_a_screened_prompt_serves_an_identical_one_that_wants_logprobs() -> None:
    """The exact-match path keeps the prompt's last hidden state, not the screened row's
    partial logits: an identical prompt asking for logprobs gets its full logits from it."""
    prompt = prompt_of(11)
    engine = make_engine("gemma3", lm_head_screen="on")
    first = engine.step(StepBatch(new_sequences=[NewSequence("greedy", prompt)], work=[WorkItem("greedy", 1024)]))
    assert first.screened_rows == 1
    engine.step(StepBatch(free_seq_ids=["greedy"]))
    wants_logprobs = SamplingParams(logprobs=True, top_logprobs=3)
    out = engine.step(StepBatch(new_sequences=[NewSequence("again", prompt, [], wants_logprobs)],
                                work=[WorkItem("again", 1024)]))
    assert (out.prompt_logits_hits, out.prompt_tokens, out.full_rows) == (1, 0, 1)
    engine.step(StepBatch(free_seq_ids=["again"]))
    # The greedy draw's screened row was kept: a third greedy request needs no LM head.
    third = engine.step(StepBatch(new_sequences=[NewSequence("third", prompt)], work=[WorkItem("third", 1024)]))
    assert (third.prompt_logits_hits, third.screened_rows, third.full_rows) == (1, 0, 0)
    assert third.results[0].token_id == first.results[0].token_id
    reference = make_engine("gemma3", lm_head_screen="off")
    expected = reference.step(StepBatch(new_sequences=[NewSequence("x", prompt, [], wants_logprobs)],
                                        work=[WorkItem("x", 1024)]))
    got, want = out.results[0].logprob, expected.results[0].logprob
    assert got is not None and want is not None
    assert got.logprob == pytest.approx(want.logprob, abs=1e-5)
    assert [top.token_id for top in got.top] == [top.token_id for top in want.top]
    assert [top.logprob for top in got.top] == pytest.approx([top.logprob for top in want.top], abs=1e-5)


def test_auto_builds_the_screen_in_the_background_for_a_large_vocabulary() -> None:
    model = build_model(gemma3_config(vocab_size=MIN_SCREENED_VOCAB))
    engine = build_engine(EngineConfig(model_dir="", num_blocks=64, block_size=4), model=model)
    assert engine.wait_for_screen(timeout=60)
    assert engine.lm_head_screened
    out = engine.step(StepBatch(new_sequences=[NewSequence("a", prompt_of(9))], work=[WorkItem("a", 1024)]))
    assert out.results[0].sampled and out.screened_rows == 1


def test_a_screen_that_fails_to_build_leaves_the_full_head_serving(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(cls, *args, **kwargs):
        raise RuntimeError("packing failed")

    monkeypatch.setattr(LMHeadScreen, "create", classmethod(broken))
    engine = make_engine("gemma3", lm_head_screen="on")
    assert engine.wait_for_screen(timeout=5) and not engine.lm_head_screened
    prompts = {"a": prompt_of(7)}
    got = Driver(engine).run(prompts, 5)
    assert_greedy_matches(reference_model("gemma3"), prompts, got, 5)


def test_an_lm_head_with_a_bias_is_not_screened() -> None:
    model = build_model(llama_config())
    biased = torch.nn.Linear(model.lm_head.in_features, model.lm_head.out_features, bias=True)
    with torch.no_grad():
        biased.weight.copy_(model.lm_head.weight)
        biased.bias.normal_()
    model.lm_head = biased
    engine = build_engine(EngineConfig(model_dir="", num_blocks=64, block_size=4, lm_head_screen="on"), model=model)
    assert not engine.lm_head_screened


def test_auto_leaves_small_vocabularies_to_the_full_head() -> None:
    engine = make_engine("gemma3")          # auto; the tiny model's vocabulary is 384
    assert engine.wait_for_screen(timeout=5)
    assert not engine.lm_head_screened
    with pytest.raises(ValueError, match="LM head screen mode"):
        make_engine("gemma3", lm_head_screen="sometimes")


def test_an_identical_greedy_prompt_reuses_the_screened_row_and_another_draw_recomputes() -> None:
    prompt = prompt_of(13)
    engine = make_engine("gemma3", lm_head_screen="on")

    def first_token(seq_id: str, params: SamplingParams = SamplingParams()) -> StepOutput:
        out = engine.step(StepBatch(new_sequences=[NewSequence(seq_id, prompt, [], params)],
                                    work=[WorkItem(seq_id, 1024)]))
        engine.step(StepBatch(free_seq_ids=[seq_id]))
        return out

    cold = first_token("cold")
    assert (cold.prompt_logits_hits, cold.screened_rows) == (0, 1)
    again = first_token("again")
    assert (again.prompt_logits_hits, again.prompt_tokens, again.screened_rows, again.full_rows) == (1, 0, 0, 0)
    assert again.results[0].token_id == cold.results[0].token_id
    # Top-3 sampling reads three best tokens: the greedy row does not serve it, the kept hidden state does.
    top_k = first_token("top-k", SamplingParams(temperature=1.0, top_k=3, seed=7))
    assert (top_k.prompt_logits_hits, top_k.prompt_tokens, top_k.screened_rows) == (1, 0, 1)
    fresh = make_engine("gemma3", lm_head_screen="on")
    want = fresh.step(StepBatch(new_sequences=[NewSequence("x", prompt, [], SamplingParams(temperature=1.0, top_k=3,
                                                                                          seed=7))],
                                work=[WorkItem("x", 1024)]))
    assert top_k.results[0].token_id == want.results[0].token_id
