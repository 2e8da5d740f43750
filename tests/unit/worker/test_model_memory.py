"""Model preparation keeps no weight inside the checkpoint's memory mapping (every page of it
read would stay resident while one view of it lived), and lets each copied weight's mapped
pages go as it copies them (never anonymous memory), with the same weights: for transformers'
model classes and for our own (engine/models/)."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from services.worker.engine.cpu import host_memory
from services.worker.engine.model import _load_model
from tests.fixtures.tiny_model import save_tiny_model


def _no_release():
    return lambda address, nbytes: 0


def _mapped_ranges(name: str) -> list[tuple[int, int]]:
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.endswith(name):
            start, end = line.split()[0].split("-")
            ranges.append((int(start, 16), int(end, 16)))
    return ranges


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="needs /proc (Linux)")
@pytest.mark.parametrize("own", [False, True], ids=["transformers", "own"])
def test_loaded_weights_own_their_memory(tmp_path: Path, own: bool) -> None:
    import torch

    directory = save_tiny_model(tmp_path / "tiny")
    model = _load_model(str(directory), torch.float32, host_memory.checkpoint_page_release, own)
    gc.collect()
    mapped = _mapped_ranges("model.safetensors")
    for tensor in (*model.parameters(), *model.buffers()):
        address = tensor.data_ptr()
        assert not any(start <= address < end for start, end in mapped)
    assert mapped == []       # nothing holds the mapping open any more


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="needs /proc (Linux)")
@pytest.mark.parametrize("own", [False, True], ids=["transformers", "own"])
def test_each_copied_weight_lets_its_mapped_pages_go(tmp_path: Path, own: bool) -> None:
    import torch

    directory = save_tiny_model(tmp_path / "tiny")
    released: list[int] = []

    def counting():
        release = host_memory.checkpoint_page_release()
        assert host_memory.file_mappings()                 # the checkpoint is mapped while it loads
        return lambda address, nbytes: released.append(release(address, nbytes))

    model = _load_model(str(directory), torch.float32, counting, own)
    assert sum(released) > 0
    reference = _load_model(str(directory), torch.float32, _no_release, False)
    got, expected = model.state_dict(), reference.state_dict()
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[name], expected[name]) for name in got)


def test_anonymous_memory_is_never_released() -> None:
    import torch

    weights = torch.arange(1 << 20, dtype=torch.float32)
    assert host_memory.release_file_pages(weights.data_ptr(), weights.numel() * 4, host_memory.file_mappings()) == 0
    assert torch.equal(weights, torch.arange(1 << 20, dtype=torch.float32))
    inside = [(weights.data_ptr(), weights.data_ptr() + (2 << 20))]
    assert host_memory.release_file_pages(weights.data_ptr(), 100, inside) == 0   # no whole page: nothing
