"""A checkpoint's config.json as attributes, for models built without transformers (models/).

It answers what the engine reads of transformers' `PretrainedConfig`: the keys of the file as
attributes, `get_text_config()` (the config itself: a text decoder), `name_or_path`, and the
defaults the engine relies on where a key is absent (`head_dim`, `tie_word_embeddings`). A key
absent from the file is an AttributeError, so `getattr(config, key, default)` reads as it does
on transformers' configs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class TextConfig:
    def __init__(self, values: dict[str, Any], name_or_path: str = "") -> None:
        values = dict(values)
        values.setdefault("tie_word_embeddings", True)
        values.setdefault("pad_token_id", None)
        if values.get("head_dim") is None and "hidden_size" in values and "num_attention_heads" in values:
            values["head_dim"] = values["hidden_size"] // values["num_attention_heads"]
        self.__dict__.update(values)
        self.name_or_path = name_or_path

    @classmethod
    def read(cls, model_dir: str | Path) -> TextConfig:
        path = Path(model_dir) / "config.json"
        return cls(json.loads(path.read_text()), str(model_dir))

    def get(self, key: str, default: Any = None) -> Any:
        return self.__dict__.get(key, default)

    def get_text_config(self) -> TextConfig:
        return self

    def __repr__(self) -> str:
        return f"TextConfig({self.get('model_type')!r}, {self.name_or_path!r})"
