"""Prompts tokenized only past the start they share with a recent prompt (text/prompt_prefixes.py):
the ids are always those of tokenizing the whole text (Gemma 3's tokenizer and a small
SentencePiece-style one whose merges cross spaces, on random texts cut at random places); the
guard characters matter (without them the probe fails); pipelines of another shape are tokenized
in full; the bound and per-start limit hold; and through the app a tenant never reuses another
tenant's prompt (with keys), so how long its prompt took to tokenize says nothing about others'."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

from common.common_prefix import common_prefix_len
from common.model_store import default_cache_dir
from services.gateway.app import create_app
from services.gateway.settings import GatewaySettings
from services.gateway.tenancy.tenant_config import load_tenants
from services.gateway.text.prompt_prefixes import (
    ANCHORS,
    MAX_SCAN,
    PER_ANCHOR,
    PROBE,
    PromptPrefixes,
    SplitRule,
)
from services.gateway.text.text_tokenizer import TextTokenizer
from tests.unit.gateway.fakes import FakeScheduler

GEMMA_DIR = default_cache_dir() / "gemma-3-270m-f32"
PIECES = ["the", "report", "café", "東京", "😀", ">", "</", "<b>", "a", "of", "x1", "—", ".", ",", "\n",
          "\t", "  ", "   ", "> </", "naïve", "def", "return", "(a, b):", "'", '"', "3.5", "°C"]


UNTRAINED = [*PIECES, "zq", "kw", "jv"]     # with words the small tokenizer was not trained on


def random_text(rng: random.Random, words: int, pieces: list[str] = PIECES) -> str:
    parts = []
    for _ in range(words):
        parts.append(rng.choice(pieces))
        parts.append(rng.choice([" ", " ", " ", "", "  ", "\n"]))
    return "".join(parts)


@pytest.fixture(scope="module")
def gemma() -> TextTokenizer:
    if not (GEMMA_DIR / "tokenizer.json").is_file():
        pytest.skip("default model not cached")
    return TextTokenizer.from_dir(GEMMA_DIR)


def sentencepiece_style() -> TextTokenizer:
    """BPE over the whole text after " " -> "▁" (no pre-tokenizer), trained here so that its
    merges cross spaces ("e▁t"...): its rule's guard holds many characters."""
    backend = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    backend.normalizer = normalizers.Replace(" ", "▁")
    rng = random.Random(7)
    corpus = [random_text(rng, 60) for _ in range(300)]
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<bos>", "<eos>"],
                                  initial_alphabet=[f"<0x{byte:02X}>" for byte in range(256)])
    backend.train_from_iterator(corpus, trainer)
    backend.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", backend.token_to_id("<bos>"))])
    return TextTokenizer(backend, {"bos_token": "<bos>", "eos_token": "<eos>"})


def check_random_prompts(tokenizer: TextTokenizer, seed: int, rounds: int) -> int:
    """Documents, then texts that share a random start of one of them: every text's ids as
    tokenizing it whole gives them; returns how many reused a start."""
    rule = SplitRule.of(tokenizer)
    assert rule is not None
    prefixes = PromptPrefixes(rule, max_tokens=1 << 20)
    rng = random.Random(seed)
    pieces = UNTRAINED
    documents = [random_text(rng, 400, pieces) for _ in range(4)]
    reused = 0
    for _ in range(rounds):
        document = rng.choice(documents)
        cut = rng.randrange(ANCHORS[0], len(document))
        text = document[:cut] + random_text(rng, rng.randrange(0, 12), pieces)
        special = rng.random() < 0.8
        ids, head = prefixes.encode(tokenizer, text, special, salt="")
        assert ids == tokenizer.encode(text, add_special_tokens=special), (cut, text[cut - 20:cut + 20])
        reused += head > 0
    prefixes.check_invariants()
    return reused


def test_gemma_prompts_are_tokenized_as_in_full(gemma: TextTokenizer) -> None:
    rule = SplitRule.of(gemma)
    assert rule is not None and rule.guard == frozenset({">"})
    assert check_random_prompts(gemma, seed=1, rounds=300) > 200


def test_merges_across_spaces_are_guarded() -> None:
    tokenizer = sentencepiece_style()
    rule = SplitRule.of(tokenizer)
    assert rule is not None and len(rule.guard) > 5
    assert check_random_prompts(tokenizer, seed=2, rounds=300) > 50


def test_without_its_guard_gemma_would_split_a_token(gemma: TextTokenizer) -> None:
    """'>▁</' is one token: splitting before its space changes the ids, which the probe catches."""
    assert "<p> </p>" in PROBE
    assert not SplitRule(frozenset()).probe(gemma)
    text = "x" * 600 + " a> </b"
    at = text.index(" </")
    assert gemma.encode(text[:at]) + gemma.encode(text[at:], add_special_tokens=False) != gemma.encode(text)
    assert SplitRule(frozenset({">"})).split_before(text, len(text)) < at


def test_split_points_skip_space_runs_and_guards() -> None:
    rule = SplitRule(frozenset({">"}))
    assert rule.split_before("ab  cd", 6) == 2          # the run's first space
    assert rule.split_before("ab  cd", 3) == 2
    assert rule.split_before("a> b", 4) == 0            # after a guard: not a split point
    assert rule.split_before("  ab", 4) == 0            # a text's leading spaces: none
    assert common_prefix_len("abcdef", "abcxyz") == 3 and common_prefix_len("", "a") == 0
    flood = "word " + "> " * 10_000                 # no point but the first, past MAX_SCAN spaces
    assert rule.split_before(flood, len(flood)) == 0
    assert rule.split_before(flood, 4 + 2 * (MAX_SCAN - 2)) == 4


def test_other_pipelines_are_tokenized_in_full(tokenizer: Any) -> None:
    assert SplitRule.of(tokenizer) is None                    # byte-level BPE (transformers' tokenizer)
    prepended = sentencepiece_style()
    prepended.backend_tokenizer.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])   # Llama 2's: not local
    assert SplitRule.of(prepended) is None
    digits = sentencepiece_style()
    digits.backend_tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("[0-9]"), "isolated")
    assert SplitRule.of(digits) is None
    prefixes = PromptPrefixes(None, max_tokens=1 << 20)
    text = "word " * 200
    assert prefixes.encode(gemma_free_tokenizer(), text, True, salt="") == (list(range(3)), 0)


def gemma_free_tokenizer() -> Any:
    class Counting:
        def encode_with_starts(self, text: str, add_special_tokens: bool = True) -> tuple[list[int], list[int]]:
            return [0, 1, 2], [0, 0, 1]
    return Counting()


def test_the_bound_and_the_texts_a_start_keeps(gemma: TextTokenizer) -> None:
    rule = SplitRule.of(gemma)
    start = "Shared start of every prompt here. " * 20           # 700 characters: one key
    prefixes = PromptPrefixes(rule, max_tokens=2_000)
    for index in range(PER_ANCHOR + 2):
        prefixes.encode(gemma, start + f"Question {index}?", True, salt="")
        prefixes.check_invariants()
    assert len(prefixes._entries) == PER_ANCHOR
    prefixes.encode(gemma, start + "Question 5?", True, salt="")   # the same text again: one entry
    assert len(prefixes._entries) == PER_ANCHOR
    for index in range(12):                        # other starts push the oldest out
        prefixes.encode(gemma, f"Other {index}. " + start, True, salt="")
        prefixes.check_invariants()
    assert prefixes.tokens <= 2_000
    small = PromptPrefixes(rule, max_tokens=10)     # a text longer than the bound is not kept
    small.encode(gemma, start, True, salt="")
    assert small.tokens == 0
    small.check_invariants()


def test_many_conversations_behind_one_system_prompt_each_find_their_own(gemma: TextTokenizer) -> None:
    """Twenty conversations share a 300-character system prompt (one short key for them all,
    which keeps PER_ANCHOR): each one's next turn still reuses its own history, found under its
    1,024-character key."""
    prefixes = PromptPrefixes(SplitRule.of(gemma), max_tokens=1 << 20)
    system = "You are a careful assistant for the billing team. Answer briefly. " * 5
    rng = random.Random(4)
    histories = [system + random_text(rng, 300) for _ in range(20)]
    for history in histories:
        prefixes.encode(gemma, history, True, salt="tenant:a")
    for history in histories:
        text = history + " And one more question?"
        ids, head = prefixes.encode(gemma, text, True, salt="tenant:a")
        assert ids == gemma.encode(text)
        assert head > len(gemma.encode(history)) // 2
    prefixes.check_invariants()


def test_short_shared_starts_and_no_salt_tokenize_in_full(gemma: TextTokenizer) -> None:
    prefixes = PromptPrefixes(SplitRule.of(gemma), max_tokens=1 << 20)
    document = "Lorem ipsum dolor sit amet, consectetur adipiscing elit. " * 20
    prefixes.encode(gemma, document, True, salt="")
    assert prefixes.encode(gemma, document[:ANCHORS[0] + 10] + " tail words here" * 40, True, salt="")[1] == 0
    assert prefixes.encode(gemma, document + " more", True, salt=None)[1] == 0
    assert prefixes.encode(gemma, document + " more", False, salt="")[1] == 0   # kept with its BOS only
    ids, head = prefixes.encode(gemma, document + " more", True, salt="")
    assert head > 0 and ids == gemma.encode(document + " more")


KEYS = "alice=sk-alice,bob=sk-bob"
DOCUMENT = random_text(random.Random(3), 200, UNTRAINED)  # ~750 characters, ~200 of the small tokenizer's tokens


async def complete(app: Any, key: str | None, prompt: str) -> None:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as http:
        reply = await http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2}, headers=headers)
    assert reply.status_code == 200, reply.text


@pytest.fixture
def make_prefix_app(reply_ids: list[int]) -> Callable[..., tuple[Any, FakeScheduler]]:
    tokenizer = sentencepiece_style()

    def build(**settings: Any) -> tuple[Any, FakeScheduler]:
        fake = FakeScheduler(reply_ids=[tokenizer.eos_token_id])
        return create_app(GatewaySettings(**settings), fake, tokenizer), fake
    return build


async def test_a_tenant_reuses_its_own_prompts_starts_only(make_prefix_app: Callable[..., Any]) -> None:
    """Bob sends a prompt that starts as Alice's did: tokenized in full, so its timing tells him
    nothing of hers; Alice's next prompt with that start reuses it, with the same ids as in full."""
    app, fake = make_prefix_app(tenants=load_tenants(KEYS))
    state = app.state.gateway
    assert state.prompt_prefixes.enabled
    prefix = state.metrics.prompt_tokens_cache["prefix"]
    await complete(app, "sk-alice", DOCUMENT + "Q: how much?")
    await complete(app, "sk-bob", DOCUMENT + "Q: who knew?")
    assert prefix._value.get() == 0
    await complete(app, "sk-alice", DOCUMENT + "Q: since when?")
    assert prefix._value.get() == 1
    tokenizer = state.tokenizer
    assert list(fake.requests[2].spec.prompt_token_ids) == tokenizer.encode(DOCUMENT + "Q: since when?")
    assert list(fake.requests[1].spec.prompt_token_ids) == tokenizer.encode(DOCUMENT + "Q: who knew?")


@pytest.mark.parametrize("settings", [{"prompt_tokens_cache_tokens": 0},
                                      {"prefix_cache_scope": "user", "tenants": load_tenants(KEYS)}])
async def test_off_or_per_user_reuses_nothing(make_prefix_app: Callable[..., Any], settings: dict[str, Any]) -> None:
    app, _ = make_prefix_app(**settings)
    key = "sk-alice" if "tenants" in settings else None
    await complete(app, key, DOCUMENT + "Q: one?")
    await complete(app, key, DOCUMENT + "Q: two?")
    assert app.state.gateway.metrics.prompt_tokens_cache["prefix"]._value.get() == 0
