"""Structured output on the worker: matchers, masks, drafts, replay, the sampler's mask and the
engine end to end, on the tiny tokenizer (384 tokens) and a tiny random model, whose random
tokens are what a constraint has to hold in check."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
import torch

from common.grammar import json_schema_constraint
from common.types import Constraint, ConstraintKind, SamplingParams
from common.step import NewSequence, StepBatch, WorkItem
from services.worker.engine.sampling.grammar import Grammars, GrammarTokenizer
from services.worker.engine.sampling.sampler import SampleRequest, Sampler
from tests.fixtures.tiny_model import build_tokenizer
from tests.unit.worker.engine_helpers import make_engine

EOS = 1
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "level": {"type": "integer", "minimum": 1, "maximum": 5},
    "kind": {"enum": ["a", "bb"]},
    "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
    "required": ["name", "level", "kind"], "additionalProperties": False}


@pytest.fixture(scope="module")
def hf_tokenizer():
    return build_tokenizer()


@pytest.fixture(scope="module")
def grammars(hf_tokenizer) -> Grammars:
    import llguidance.hf
    vocab = len(hf_tokenizer)
    tokenizer = GrammarTokenizer(lambda: llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab, eos_token=EOS),
                                 background=False)
    return Grammars(tokenizer, vocab, [EOS])


def walk(state, vocab: int, seed: int, limit: int = 200) -> list[int]:
    """Tokens drawn by argmax of seeded random logits under the mask, until EOS."""
    rng = np.random.default_rng(seed)
    tokens: list[int] = []
    for _ in range(limit):
        banned = state.banned()
        logits = np.where(banned, -np.inf, rng.standard_normal(vocab))
        token = int(logits.argmax())
        assert not banned[token]
        if token == EOS:
            return tokens
        state.advance([token])
        tokens.append(token)
    raise AssertionError(f"no EOS after {limit} tokens")


@pytest.mark.parametrize("seed", range(6))
def test_masked_walks_validate_against_the_schema(grammars, hf_tokenizer, seed):
    state = grammars.state(json_schema_constraint(SCHEMA))
    text = hf_tokenizer.decode(walk(state, grammars.vocab_size, seed))
    value = json.loads(text)
    jsonschema.validate(value, SCHEMA)
    assert list(value) == [key for key in SCHEMA["properties"] if key in value]   # the schema's order


@pytest.mark.parametrize("seed", range(4))
def test_regex_choice_and_grammar_walks_match(grammars, hf_tokenizer, seed):
    regex = grammars.state(Constraint(ConstraintKind.REGEX, r"[a-c]{2,4}-[0-9]{3}"))
    assert re.fullmatch(r"[a-c]{2,4}-[0-9]{3}", hf_tokenizer.decode(walk(regex, grammars.vocab_size, seed)))
    choice = grammars.state(Constraint(ConstraintKind.CHOICE, choices=("yes", "no", "a \"quoted\" one")))
    assert hf_tokenizer.decode(walk(choice, grammars.vocab_size, seed)) in ("yes", "no", "a \"quoted\" one")
    gbnf = grammars.state(Constraint(ConstraintKind.GRAMMAR, 'root ::= "(" [0-9] ("+" [0-9])? ")"'))
    assert re.fullmatch(r"\([0-9](\+[0-9])?\)", hf_tokenizer.decode(walk(gbnf, grammars.vocab_size, seed)))


def test_eos_only_where_the_output_is_a_whole_match(grammars, hf_tokenizer):
    state = grammars.state(Constraint(ConstraintKind.REGEX, "ab+"))
    assert state.banned()[EOS]
    state.advance(hf_tokenizer.encode("a", add_special_tokens=False))
    assert state.banned()[EOS]
    state.advance(hf_tokenizer.encode("b", add_special_tokens=False))
    assert not state.banned()[EOS]
    done = grammars.state(Constraint(ConstraintKind.CHOICE, choices=("yes",)))
    done.advance(hf_tokenizer.encode("yes", add_special_tokens=False))
    assert done.finished
    assert np.flatnonzero(~done.banned()).tolist() == [EOS]     # a finished grammar allows only EOS


def test_compiled_grammars_are_cached_by_constraint(grammars):
    before = grammars.compiles
    constraint = json_schema_constraint({"type": "object", "properties": {"x": {"type": "integer"}}})
    grammars.state(constraint).banned()
    grammars.state(json_schema_constraint({"type": "object", "properties": {"x": {"type": "integer"}}})).banned()
    assert grammars.compiles == before + 1


def test_draft_rows_are_masked_as_if_drafts_were_output_and_rolled_back(grammars, hf_tokenizer):
    constraint = Constraint(ConstraintKind.REGEX, "abcabc")
    drafts = hf_tokenizer.encode("abcabc", add_special_tokens=False)[:3]
    state = grammars.state(constraint)
    rows = state.banned_rows(drafts)
    assert len(rows) == len(drafts) + 1
    expected = grammars.state(constraint)
    for row, token in zip(rows, [*drafts, None]):
        assert np.array_equal(row, expected.banned())
        if token is not None:
            expected.advance([token])
    assert np.array_equal(state.banned(), grammars.state(constraint).banned())   # rolled back
    bad = hf_tokenizer.convert_tokens_to_ids("z")
    refused = state.banned_rows([drafts[0], bad, drafts[0]])
    assert refused[1][bad]     # the row at the refused draft forbids it: the draw there ends the run
    assert len(refused) == 4


def test_replayed_output_restores_the_matcher(grammars, hf_tokenizer):
    constraint = json_schema_constraint(SCHEMA)
    state = grammars.state(constraint)
    tokens = walk(state, grammars.vocab_size, seed=3)[:5]
    live = grammars.state(constraint)
    live.advance(tokens)
    resumed = grammars.state(constraint, replay=tokens)
    assert np.array_equal(resumed.banned(), live.banned())


def test_sampler_never_draws_a_banned_token_and_the_grammar_wins_over_min_tokens():
    vocab = 50
    sampler = Sampler(seed=0, eos_token_ids=[EOS])
    allowed = [7, 11, 30]
    bias = np.full(vocab, -np.inf, dtype=np.float32)
    bias[allowed] = 0.0
    logits = torch.randn(4, vocab) * 5
    requests = [SampleRequest(SamplingParams(temperature=t, seed=i), [2], [], 0, grammar_bias=bias)
                for i, t in enumerate((0.0, 0.7, 1.5, 0.0))]
    for _ in range(20):
        assert all(s.token_id in allowed for s in sampler.sample(logits, requests))
        logits = torch.randn(4, vocab) * 5
    only_eos = np.full(vocab, -np.inf, dtype=np.float32)
    only_eos[EOS] = 0.0
    request = SampleRequest(SamplingParams(min_tokens=5), [2], [], 0, grammar_bias=only_eos)
    assert sampler.sample(torch.randn(1, vocab), [request])[0].token_id == EOS


def constrained_engine(hf_tokenizer, grammars, **config):
    engine = make_engine("gemma3", **config)
    engine.grammars = grammars
    return engine


def run_to_eos(engine, seq_id: str, sampling: SamplingParams, output: tuple[int, ...] = (),
               draft_tokens: int = 0, limit: int = 120, drafts: list[int] | None = None) -> list[int]:
    prompt = (2, 40, 41, 42, 43)
    engine.step(StepBatch(new_sequences=(NewSequence(seq_id, prompt, output, sampling),), work=()))
    tokens = list(output)
    num = len(prompt) + len(output)
    for _ in range(limit):
        step = engine.step(StepBatch(work=(WorkItem(seq_id, num, draft_tokens if tokens else 0),)))
        result = step.results[0]
        if drafts is not None:
            drafts.append(step.draft_tokens)
        assert not result.error, result.error
        num = 1
        for token in result.token_ids:
            if token == EOS:
                return tokens
            tokens.append(token)
    raise AssertionError("no EOS")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_engine_constrained_outputs_validate(hf_tokenizer, grammars, temperature):
    engine = constrained_engine(hf_tokenizer, grammars)
    for index in range(3):
        sampling = SamplingParams(temperature=temperature, seed=index, constraint=json_schema_constraint(SCHEMA))
        text = hf_tokenizer.decode(run_to_eos(engine, f"s{index}", sampling))
        jsonschema.validate(json.loads(text), SCHEMA)


def test_engine_resumed_sequence_continues_its_grammar(hf_tokenizer, grammars):
    engine = constrained_engine(hf_tokenizer, grammars)
    sampling = SamplingParams(temperature=1.0, seed=5, constraint=json_schema_constraint(SCHEMA))
    whole = run_to_eos(engine, "whole", sampling)
    # The same request resumed after its first 4 tokens (a preemption or a moved request): the same text.
    assert run_to_eos(engine, "resumed", sampling, output=tuple(whole[:4])) == whole


def test_engine_speculative_drafts_are_checked_against_the_grammar(hf_tokenizer, grammars):
    engine = constrained_engine(hf_tokenizer, grammars)
    regex = r"(ab){6}c"
    sampling = SamplingParams(constraint=Constraint(ConstraintKind.REGEX, regex))
    plain = run_to_eos(engine, "plain", sampling)
    verified: list[int] = []
    drafted = run_to_eos(engine, "drafted", sampling, draft_tokens=3, drafts=verified)
    assert sum(verified) > 0
    assert drafted == plain
    assert re.fullmatch(regex, hf_tokenizer.decode(drafted))


@pytest.mark.parametrize("mode", ["first_use", "start"])
def test_the_tokenizer_is_built_at_start_or_when_the_first_constrained_sequence_registers(tmp_path, mode):
    from services.worker.engine.config import EngineConfig
    from services.worker.wiring import build_engine
    from tests.fixtures.tiny_model import save_tiny_model
    save_tiny_model(tmp_path)
    engine = build_engine(EngineConfig(model_dir=str(tmp_path), num_blocks=64, block_size=4, grammar_tokenizer=mode))
    tokenizer = engine.grammars.tokenizer
    assert tokenizer.started is (mode == "start")
    plain = SamplingParams(temperature=0.0)
    engine.step(StepBatch(new_sequences=(NewSequence("plain", (2, 40, 41), (), plain),), work=()))
    assert tokenizer.started is (mode == "start")           # an unconstrained sequence builds nothing
    constrained = SamplingParams(temperature=0.0, constraint=Constraint(ConstraintKind.REGEX, "ab"))
    engine.step(StepBatch(new_sequences=(NewSequence("json", (2, 40, 41), (), constrained),), work=()))
    assert tokenizer.started and tokenizer.wait()
    result = engine.step(StepBatch(work=(WorkItem("json", 3),))).results[0]
    assert not result.error and len(result.token_ids) == 1


def test_an_unknown_grammar_tokenizer_mode_is_refused():
    with pytest.raises(ValueError, match="GRAMMAR_TOKENIZER"):
        make_engine("gemma3", grammar_tokenizer="sometimes")


def test_the_most_choices_the_gateway_passes_still_match(grammars, hf_tokenizer):
    """common/grammar.py's MAX_CHOICES is what the worker's parser limits hold: one choice
    more and the matcher's row overflows."""
    from common.grammar import MAX_CHOICES
    from common.types import Constraint, ConstraintKind

    choices = tuple(f"option {i}" for i in range(MAX_CHOICES))
    state = grammars.state(Constraint(ConstraintKind.CHOICE, choices=choices))
    for token in hf_tokenizer.encode("option 1234", add_special_tokens=False):
        assert not state.banned()[token]
        state.advance([token])
    assert not state.banned()[EOS]


class PanicException(BaseException):
    """What pyo3 raises for a panic in the grammar library's Rust code: not an Exception."""


def test_a_grammar_library_panic_fails_its_sequence_alone(hf_tokenizer, grammars, monkeypatch):
    """A constraint the library panics on (past the gateway's check) must not take the step, and
    with it every other tenant's sequence in the batch, down: the step's isolation sees an error."""
    import llguidance

    from common.grammar import check
    from services.worker.engine.sampling import grammar as worker_grammar

    constraint = Constraint(ConstraintKind.REGEX, "a+b")
    grammar = check(constraint)

    def panics(*_args, **_kwargs):
        raise PanicException("index out of bounds")

    monkeypatch.setattr(worker_grammar, "check", lambda _constraint: grammar)
    monkeypatch.setattr(llguidance, "LLMatcher", panics)
    engine = constrained_engine(hf_tokenizer, Grammars(grammars.tokenizer, grammars.vocab_size, [EOS]))
    constrained = SamplingParams(constraint=constraint)
    prompt = (2, 40, 41, 42, 43)
    step = engine.step(StepBatch(
        new_sequences=(NewSequence("plain", prompt, (), SamplingParams()),
                       NewSequence("bad", prompt, (), constrained)),
        work=(WorkItem("plain", len(prompt)), WorkItem("bad", len(prompt)))))
    results = {result.seq_id: result for result in step.results}
    assert results["plain"].sampled and not results["plain"].error
    assert results["bad"].error is not None and not results["bad"].sampled
