"""A prepared model's tokenizer.json with its BPE merges written as "a b" strings.

`tokenizers` reads a BPE model's merges in either of two forms: pairs (`[["a", "b"], ...]`,
what it writes today) or strings split at their one space (`["a b", ...]`, the older form).
It reads pairs through an untagged enum, so the whole merges array is first buffered as
generic values: Gemma 3's 514,906 pairs took the gateway from 81 to 436 MB while its
31 MB tokenizer.json was parsed, to settle at 177 MB. The same merges as strings (and the
file without indentation) peak ~170 MB lower (one process, `Tokenizer.from_file` on the
two files: 353 against 179 MB, 2026-12-07).

`write_merges_as_strings` rewrites the file that way where it is exactly the same model:
a BPE model whose merges are all pairs of tokens without a space (a space would split the
string elsewhere), and whose tokenizer, read back from the new text, serializes to what the
old one does; otherwise it leaves the file as it is. Run once when the default model is
prepared (model_store.py), never on a user's model directory.
"""

from __future__ import annotations

import json
from pathlib import Path

from common.model_files.file_replace import replace_text


def write_merges_as_strings(path: Path) -> bool:
    """Rewrites the tokenizer.json at `path` with its merges as strings, atomically; True when
    it did, False when the file is not such a BPE tokenizer or the result would differ."""
    data = json.loads(path.read_text(encoding="utf-8"))
    model = data.get("model")
    merges = model.get("merges") if isinstance(model, dict) else None
    if not isinstance(model, dict) or model.get("type") != "BPE" or not merges or not all(_plain_pair(m) for m in merges):
        return False
    model["merges"] = [f"{first} {second}" for first, second in merges]
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    del data, model, merges
    from tokenizers import Tokenizer

    if Tokenizer.from_str(text).to_str() != Tokenizer.from_file(str(path)).to_str():
        return False
    replace_text(path, text)
    return True


def _plain_pair(merge: object) -> bool:
    return (isinstance(merge, list) and len(merge) == 2 and all(isinstance(token, str) and token and " " not in token
                                                               for token in merge))
