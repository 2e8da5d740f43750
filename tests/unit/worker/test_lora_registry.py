"""The adapters resident on a worker: MAX_LORAS at most, loaded on demand and evicted least
recently used among those no sequence holds; MAX_LORA_RANK; runtime paths only inside
LORA_ROOT (symlinks out refused); a digest that no longer matches the file refused."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from common.model_files.peft_config import AdapterError
from services.worker.engine.lora.registry import AdapterRef, LoraConfig, LoraRegistry
from tests.fixtures.tiny_lora import save_random_adapter
from tests.fixtures.tiny_model import gemma3_config

SHAPES_OF = "model.layers.{}.self_attn.{}"


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lora-root")
    for seed, name in enumerate(("a", "b", "c")):
        save_random_adapter(root / name, gemma3_config(), seed=seed)
    save_random_adapter(root / "wide", gemma3_config(), seed=9, r=32)
    return root


def registry(root: Path) -> LoraRegistry:
    """The tiny Gemma 3's q and v projections (64 -> 64 and 64 -> 16), two adapters resident."""
    shapes = {}
    for layer in range(gemma3_config().num_hidden_layers):
        shapes[SHAPES_OF.format(layer, "q_proj")] = (64, 64)
        shapes[SHAPES_OF.format(layer, "v_proj")] = (64, 16)
    return LoraRegistry(LoraConfig(root=str(root), max_loras=2, max_rank=16), shapes, torch.device("cpu"),
                        torch.float32)


def test_lru_eviction_spares_adapters_in_use(root: Path) -> None:
    loras = registry(root)
    loras.acquire("s1", AdapterRef("a", "a"))
    loras.acquire("s2", AdapterRef("b", "b"))
    loras.release("s2")
    loras.acquire("s3", AdapterRef("c", "c"))      # b is the one not held: evicted
    assert loras.resident() == ["a", "c"] and loras.evictions == 1
    with pytest.raises(AdapterError, match="MAX_LORAS=2"):
        loras.acquire("s4", AdapterRef("b", "b"))  # a and c are both held
    loras.release("s1")
    loras.acquire("s4", AdapterRef("b", "b"))
    assert loras.resident() == ["c", "b"] and loras.loads == 4


def test_max_lora_rank(root: Path) -> None:
    with pytest.raises(AdapterError, match="MAX_LORA_RANK=16"):
        registry(root).acquire("s", AdapterRef("wide", "wide"))


def test_paths_outside_lora_root_are_refused(root: Path, tmp_path: Path) -> None:
    """The attack: a sequence names a directory outside LORA_ROOT, or a symlink out of it."""
    outside = tmp_path / "outside"
    save_random_adapter(outside, gemma3_config(), seed=5)
    link = root / "link-out"
    if not link.exists():
        os.symlink(outside, link)
    loras = registry(root)
    for path in (str(outside), "../outside", "link-out", str(root / ".." / "outside")):
        with pytest.raises(AdapterError, match="lora_path"):
            loras.acquire("s", AdapterRef("evil", path))
    with pytest.raises(AdapterError, match="lora_name"):
        loras.acquire("s", AdapterRef("../a", "a"))
    assert loras.resident() == []
    off = LoraRegistry(LoraConfig(modules={"a": str(root / "a")}), {}, torch.device("cpu"), torch.float32)
    with pytest.raises(AdapterError, match="LORA_ROOT is not set"):
        off.acquire("s", AdapterRef("b", str(root / "b")))


def test_a_digest_that_does_not_match_is_refused(root: Path) -> None:
    loras = registry(root)
    with pytest.raises(AdapterError, match="weights changed"):
        loras.acquire("s", AdapterRef("a", "a", "0" * 16))
    adapter = loras.acquire("s", AdapterRef("a", "a"))
    assert loras.acquire("t", AdapterRef("a", "a", adapter.digest[:16])) is adapter
