"""Model preparation keeps no weight inside the checkpoint's memory mapping (every page of it
read would stay resident while one view of it lived), and lets each copied weight's mapped
pages go as it copies them (never anonymous memory), with the same weights: for transformers'
model classes and for our own (engine/models/). On CPU the weight matrices stay views until the
speed-ups have read them (weight codes), whose pages go as they are read: a checkpoint whose
matrices are exact codes is never copied whole, and the engine gives the same tokens."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from services.worker.engine.cpu import host_memory
from services.worker.engine.model import _load_model
from tests.fixtures.tiny_model import save_tiny_model
from tests.unit.worker.test_weight_codes import snap_to_codes


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
    model, _ = _load_model(str(directory), torch.float32, host_memory.checkpoint_page_release, own)
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

    model, _ = _load_model(str(directory), torch.float32, counting, own)
    assert sum(released) > 0
    reference, _ = _load_model(str(directory), torch.float32, _no_release, False)
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


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="needs /proc (Linux)")
def test_deferred_matrices_stay_mapped_until_the_speedups(tmp_path: Path) -> None:
    import torch

    directory = save_tiny_model(tmp_path / "tiny")
    model, pages = _load_model(str(directory), torch.float32, host_memory.checkpoint_page_release, True,
                               defer_matrices=True)
    tensors = [*model.parameters(), *model.buffers()]
    assert any(tensor.dim() == 2 and pages.holds(tensor) for tensor in tensors)
    assert not any(tensor.dim() != 2 and pages.holds(tensor) for tensor in tensors)   # norms copied out
    reference, _ = _load_model(str(directory), torch.float32, _no_release, True)
    got, expected = model.state_dict(), reference.state_dict()
    assert all(torch.equal(got[name], expected[name]) for name in expected)


def _coded_checkpoint(directory: Path) -> tuple[Path, "torch.nn.Module"]:
    """A tiny Gemma 3 checkpoint whose matrices are exact 4-bit codes, as a GGUF one dequantized."""
    from transformers import AutoModelForCausalLM

    save_tiny_model(directory)
    model = AutoModelForCausalLM.from_pretrained(directory)
    assert snap_to_codes(model) > 0
    model.save_pretrained(directory)
    return directory, model


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="needs /proc (Linux)")
@pytest.mark.parametrize("impl", ["auto", "transformers"])
def test_a_coded_checkpoint_is_read_into_codes_and_let_go(tmp_path: Path, impl: str) -> None:
    """The engine prepared from a checkpoint of exact codes: every matrix's mapped pages go once
    the codes have read them, nothing the model holds is left in the mapping (so it closes once
    the LM head screen is built), and the tokens are transformers' own."""
    import dataclasses

    from services.worker.engine.config import EngineConfig
    from services.worker.engine.engine import Engine
    from services.worker.wiring import device_accelerators
    from tests.unit.worker.engine_helpers import Driver, assert_greedy_matches, prompt_of

    directory, reference = _coded_checkpoint(tmp_path / "coded")
    released: list[int] = []

    class Counting(host_memory.CheckpointPages):
        def release(self, tensor):
            released.append(super().release(tensor))
            return released[-1]

    def counting():
        return Counting(host_memory.file_mappings(), host_memory.glibc_madvise())

    accelerators = dataclasses.replace(device_accelerators(), checkpoint_page_release=counting)
    engine = Engine(EngineConfig(model_dir=str(directory), num_blocks=64, block_size=4, model_key="coded",
                                 model_impl=impl), accelerators=accelerators)
    assert engine.wait_for_screen(timeout=60)
    assert engine.coded_linears > 0 and sum(released) > 0
    gc.collect()
    mapped = _mapped_ranges("model.safetensors")
    model = engine.prepared.model
    for tensor in (*model.parameters(), *model.buffers()):
        assert not any(start <= tensor.data_ptr() < end for start, end in mapped)
    assert mapped == []
    prompts = {"a": prompt_of(7, 1), "b": prompt_of(30, 2)}
    got = Driver(engine).run(prompts, 10, chunk={"b": 9})
    assert_greedy_matches(reference, prompts, got, 10)
