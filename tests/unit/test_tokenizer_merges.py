"""A prepared tokenizer.json's BPE merges written as "a b" strings (common/tokenizer_merges.py):
the same tokenizer (serialization and ids), only where every merge is a pair of tokens without a
space, never half a file; and a directory prepared before gets them once, or, read-only, serves as
it is (common/model_store.py)."""

from __future__ import annotations

import json
import stat
from pathlib import Path

from tokenizers import Tokenizer

from common import model_store
from common.model_files.tokenizer_merges import write_merges_as_strings
from tests.fixtures.tiny_model import build_tokenizer

TEXTS = ["Hello, world!", "fn main() { println!(\"{}\", 1 + 2); }", "Ünïcödé ✓ 日本語 😀 " * 3, "a  b\t\tc\n\nd"]


def _saved(tmp_path: Path) -> Path:
    build_tokenizer().save_pretrained(tmp_path)
    path = tmp_path / "tokenizer.json"
    assert isinstance(json.loads(path.read_text())["model"]["merges"][0], list)     # pairs, as saved today
    return path


def test_merges_become_strings_and_the_tokenizer_stays_the_same(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    path.chmod(0o644)
    before = Tokenizer.from_file(str(path))
    assert write_merges_as_strings(path)
    merges = json.loads(path.read_text())["model"]["merges"]
    assert merges and all(isinstance(merge, str) and merge.count(" ") == 1 for merge in merges)
    after = Tokenizer.from_file(str(path))
    assert after.to_str() == before.to_str()
    assert all(after.encode(text).ids == before.encode(text).ids for text in TEXTS)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert not write_merges_as_strings(path)        # already strings: nothing to do
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".tokenizer-")] == []


def test_a_token_with_a_space_keeps_the_pairs(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    data = json.loads(path.read_text())
    first = data["model"]["merges"][0]
    data["model"]["merges"][0] = [first[0] + " ", first[1]]
    text = json.dumps(data)
    path.write_text(text)
    assert not write_merges_as_strings(path)
    assert path.read_text() == text


def test_a_tokenizer_without_bpe_merges_is_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.json"
    text = json.dumps({"model": {"type": "WordLevel", "vocab": {"a": 0}, "unk_token": "a"}})
    path.write_text(text)
    assert not write_merges_as_strings(path)
    assert path.read_text() == text


def test_a_directory_prepared_before_gets_string_merges_once(tmp_path: Path, monkeypatch) -> None:
    target = model_store.default_model_dir(tmp_path)
    target.mkdir(parents=True)
    path = _saved(target)
    before = Tokenizer.from_file(str(path)).to_str()
    marker = target / model_store._MARKER
    marker.write_text(json.dumps({"format": model_store._FORMAT_VERSION}))
    assert model_store.prepare_default_model(tmp_path) == target
    assert isinstance(json.loads(path.read_text())["model"]["merges"][0], str)
    assert Tokenizer.from_file(str(path)).to_str() == before
    assert json.loads(marker.read_text())["tokenizer_merges"] == "strings"
    calls = []
    monkeypatch.setattr(model_store, "write_merges_as_strings", lambda p: calls.append(p) or True)
    model_store.prepare_default_model(tmp_path)
    assert calls == []                              # the marker says it is done


def test_a_read_only_directory_serves_as_it_is(tmp_path: Path, monkeypatch) -> None:
    """Compose mounts the prepared models read-only into the gateway: a directory prepared before
    that cannot be rewritten is served unchanged, not refused."""
    target = model_store.default_model_dir(tmp_path)
    target.mkdir(parents=True)
    path = _saved(target)
    text = path.read_text()
    (target / model_store._MARKER).write_text(json.dumps({"format": model_store._FORMAT_VERSION}))

    def read_only(path: Path) -> bool:
        raise PermissionError(13, "Read-only file system", str(path))

    monkeypatch.setattr(model_store, "write_merges_as_strings", read_only)
    assert model_store.prepare_default_model(tmp_path) == target
    assert path.read_text() == text
