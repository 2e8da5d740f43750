from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from common.model_store import default_cache_dir, default_model_dir, is_prepared
from services.gateway.text.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer, token_bytes

TEXTS = ["東京 🙂", "Zwei Äpfel kosten 3 € — naïve café", "Hello world! How are you?",
         "def add(a, b):\n    return a + b\n", "🙂🙂 emoji 東京東京"]


def stream_text(tokenizer: Any, ids: list[int], prompt: list[int] = ()) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer, prompt)
    deltas = [detokenizer.push(token_id) for token_id in ids]
    return [*deltas, detokenizer.flush()]


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_join_to_the_full_decode(tokenizer: Any, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas = stream_text(tokenizer, ids)
    assert "".join(deltas) == text
    assert not any(REPLACEMENT_CHAR in delta for delta in deltas)


def test_multibyte_character_is_held_until_complete(tokenizer: Any) -> None:
    ids = tokenizer.encode("東京 🙂", add_special_tokens=False)
    assert len(ids) > 2, "the tiny tokenizer splits these characters into byte tokens"
    detokenizer = IncrementalDetokenizer(tokenizer)
    deltas = [detokenizer.push(token_id) for token_id in ids]
    # Token boundaries of the tiny tokenizer fall inside 東, 京 and 🙂.
    assert deltas == ["", "", "東京", "", " 🙂"]
    assert detokenizer.flush() == ""


def test_prompt_context_is_not_repeated(tokenizer: Any) -> None:
    prompt = tokenizer.encode("The capital of France is", add_special_tokens=True)
    ids = tokenizer.encode(" Paris 東京", add_special_tokens=False)
    assert "".join(stream_text(tokenizer, ids, prompt)) == " Paris 東京"


def test_flush_returns_an_incomplete_tail(tokenizer: Any) -> None:
    ids = tokenizer.encode("🙂", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert [detokenizer.push(token_id) for token_id in ids[:-1]] == [""] * (len(ids) - 1)
    assert detokenizer.flush().startswith(REPLACEMENT_CHAR)


def test_special_tokens_are_skipped(tokenizer: Any) -> None:
    ids = [*tokenizer.encode("ok", add_special_tokens=False), tokenizer.eos_token_id]
    assert "".join(stream_text(tokenizer, ids)) == "ok"


@pytest.mark.skipif(not is_prepared(default_model_dir(default_cache_dir())),
                    reason="the default model is not converted here")
def test_sentencepiece_spaces_with_the_gemma_tokenizer() -> None:
    from transformers import AutoTokenizer

    gemma = AutoTokenizer.from_pretrained(str(Path(default_model_dir(default_cache_dir()))))
    prompt = gemma.encode("The capital of France is")
    for text in [" Paris, and 東京 🙂 too.", " naïve café —  two  spaces"]:
        ids = gemma.encode(text, add_special_tokens=False)
        assert "".join(stream_text(gemma, ids, prompt)) == text


def _joined_token_bytes(tokenizer: Any, ids: list[int]) -> bytes:
    return b"".join(token_bytes(tokenizer, token_id, tokenizer.decode(
        [token_id], skip_special_tokens=False, clean_up_tokenization_spaces=False))
        for token_id in ids)


@pytest.mark.parametrize("text", TEXTS)
def test_token_bytes_are_the_tokens_own_bytes(tokenizer: Any, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert any(REPLACEMENT_CHAR in tokenizer.decode([token_id]) for token_id in ids) or text.isascii()
    assert _joined_token_bytes(tokenizer, ids) == text.encode()


class _ByteFallbackVocabulary:
    """SentencePiece-style pieces: whole words, and <0xNN> for single bytes."""
    pieces = {7: "<0xF0>", 8: "<0x9F>", 9: "▁hello"}

    def convert_ids_to_tokens(self, token_id: int) -> str:
        return self.pieces[token_id]


def test_token_bytes_of_byte_fallback_pieces() -> None:
    vocabulary = _ByteFallbackVocabulary()
    assert token_bytes(vocabulary, 7, REPLACEMENT_CHAR) == b"\xf0"
    assert token_bytes(vocabulary, 8, REPLACEMENT_CHAR) == b"\x9f"
    assert token_bytes(vocabulary, 9, " hello") == b" hello"


@pytest.mark.skipif(not is_prepared(default_model_dir(default_cache_dir())),
                    reason="the default model is not converted here")
def test_token_bytes_with_the_gemma_tokenizer() -> None:
    from transformers import AutoTokenizer

    gemma = AutoTokenizer.from_pretrained(str(Path(default_model_dir(default_cache_dir()))))
    text = "東京 🙂 café \U0001FAE8 plain"  # the last emoji is spelled in byte-fallback pieces
    ids = gemma.encode(text, add_special_tokens=False)
    assert _joined_token_bytes(gemma, ids) == text.encode()
