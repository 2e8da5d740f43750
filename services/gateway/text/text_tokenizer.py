"""The gateway's tokenizer: a model directory's tokenizer.json run by the
`tokenizers` library, with the special tokens and chat template of its
tokenizer_config.json. It answers the calls the gateway makes, as
transformers' fast tokenizer answers them (tests compare the two), without
importing transformers, which would pull torch into the gateway.

Text is encoded and decoded through the library's batch calls, which release
the GIL while the Rust code runs (its single `encode` holds it): a long prompt
tokenized in a thread does not stall the event loop's streams meanwhile."""

from __future__ import annotations

import ctypes
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from services.gateway.text.jinja_chat import render_chat

_NAMED_SPECIALS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                   "cls_token", "mask_token")
_EXTRA_SPECIALS = ("additional_special_tokens", "extra_special_tokens")


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json writes a special token as a string or as an
    AddedToken dict ({"content": ...})."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _extra_special_texts(config: dict[str, Any]) -> list[str]:
    texts: list[str] = []
    for key in _EXTRA_SPECIALS:
        values = config.get(key) or []
        if isinstance(values, dict):  # {name: token}
            values = list(values.values())
        texts.extend(text for text in map(_token_text, values) if text is not None)
    return texts


def pipeline_part(part: Any) -> dict[str, Any] | None:
    """A normalizer's or pre-tokenizer's tokenizer.json entry (the part alone, not the whole
    tokenizer: Gemma's serializes to 33 MB); None for no part."""
    return None if part is None else json.loads(part.__getstate__())


def _chat_template(directory: Path, config: dict[str, Any]) -> str | None:
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        named = {item.get("name"): item.get("template") for item in template if isinstance(item, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


class TextTokenizer:
    def __init__(self, backend: Tokenizer, config: dict[str, Any],
                 chat_template: str | None = None) -> None:
        self._backend = backend
        self.chat_template = chat_template
        self.special_tokens = {name: text for name in _NAMED_SPECIALS
                               if (text := _token_text(config.get(name))) is not None}
        special_texts = [*self.special_tokens.values(), *_extra_special_texts(config)]
        ids = (backend.token_to_id(text) for text in special_texts)
        self.all_special_ids = list(dict.fromkeys(i for i in ids if i is not None))
        self.bos_token_id = self._special_id("bos_token")
        self.eos_token_id = self._special_id("eos_token")
        self.unk_token_id = self._special_id("unk_token")

    @classmethod
    def from_dir(cls, directory: Path) -> TextTokenizer:
        config_file = directory / "tokenizer_config.json"
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        backend = Tokenizer.from_file(str(directory / "tokenizer.json"))
        _release_parse_memory()
        return cls(backend, config, _chat_template(directory, config))

    def _special_id(self, name: str) -> int | None:
        text = self.special_tokens.get(name)
        return None if text is None else self._backend.token_to_id(text)

    @property
    def backend_tokenizer(self) -> Tokenizer:
        """The `tokenizers` Tokenizer (transformers' fast tokenizers name it so too)."""
        return self._backend

    def __len__(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch, not encode: it lets go of the GIL while it works.
        [encoding] = self._backend.encode_batch([text], add_special_tokens=add_special_tokens)
        return list(encoding.ids)

    def encode_with_starts(self, text: str, add_special_tokens: bool = True) -> tuple[list[int], list[int]]:
        """encode's ids and the character of `text` where each begins (0 for special tokens
        before the text), for prompt_prefixes.py."""
        [encoding] = self._backend.encode_batch([text], add_special_tokens=add_special_tokens)
        return list(encoding.ids), [start for start, _ in encoding.offsets]

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text, add_special_tokens)}

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool = False) -> str:
        if clean_up_tokenization_spaces:
            raise ValueError("clean_up_tokenization_spaces is not supported: the gateway "
                             "streams text exactly as the tokenizer decodes it")
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_long(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """decode, through the batch call that lets go of the GIL (for a long list of ids)."""
        [text] = self._backend.decode_batch([list(ids)], skip_special_tokens=skip_special_tokens)
        return text

    def convert_tokens_to_ids(self, token: str) -> int | None:
        """The token's id, or the unknown token's when the vocabulary lacks it."""
        token_id = self._backend.token_to_id(token)
        return self.unk_token_id if token_id is None else token_id

    def convert_ids_to_tokens(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def apply_chat_template(self, conversation: list[dict[str, Any]], tokenize: bool = False,
                            add_generation_prompt: bool = False,
                            tools: list[dict[str, Any]] | None = None) -> str:
        if tokenize:
            raise ValueError("apply_chat_template renders text only; encode it afterwards")
        if not self.chat_template:
            raise ValueError("the tokenizer has no chat template")
        return render_chat(self.chat_template, conversation, add_generation_prompt,
                           self.special_tokens, tools)


def _release_parse_memory() -> None:
    """Parsing a large tokenizer.json (Gemma's: 33 MB, 262k tokens) leaves
    about 200 MB of freed heap that glibc keeps mapped; hand it back."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
