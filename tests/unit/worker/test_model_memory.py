"""Model preparation keeps no weight inside the checkpoint's memory mapping
(every page of it read would stay resident while one view of it lived)."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from services.worker.engine.model import _load_model
from tests.fixtures.tiny_model import save_tiny_model


def _mapped_ranges(name: str) -> list[tuple[int, int]]:
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.endswith(name):
            start, end = line.split()[0].split("-")
            ranges.append((int(start, 16), int(end, 16)))
    return ranges


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="needs /proc (Linux)")
def test_loaded_weights_own_their_memory(tmp_path: Path) -> None:
    import torch

    directory = save_tiny_model(tmp_path / "tiny")
    model = _load_model(str(directory), torch.float32)
    gc.collect()
    mapped = _mapped_ranges("model.safetensors")
    for tensor in (*model.parameters(), *model.buffers()):
        address = tensor.data_ptr()
        assert not any(start <= address < end for start, end in mapped)
    assert mapped == []       # nothing holds the mapping open any more
