"""The allocator tuning applies once on glibc and is a no-op elsewhere; the C library is looked
up once; the GEMM caches are capped."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator

import pytest

from services.worker.engine.cpu import host_memory


def test_tuning_applies_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(host_memory, "_applied", None)
    monkeypatch.setattr(host_memory, "_tune_glibc", lambda: calls.append(1) or True)
    assert host_memory.keep_freed_host_memory() and host_memory.keep_freed_host_memory()
    assert calls == [1]


def test_glibc_accepts_the_settings() -> None:
    try:
        ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        pytest.skip("not glibc")
    assert host_memory._tune_glibc()


@pytest.fixture
def fresh_glibc_lookup() -> Iterator[None]:
    """`_glibc` looked up again in the test and after it (it is cached per process)."""
    host_memory._glibc.cache_clear()
    yield
    host_memory._glibc.cache_clear()


def test_without_glibc_nothing_changes(monkeypatch: pytest.MonkeyPatch, fresh_glibc_lookup: None) -> None:
    def no_libc(name: str) -> object:
        raise OSError("no such library")

    monkeypatch.setattr(host_memory.ctypes, "CDLL", no_libc)
    assert host_memory._tune_glibc() is False
    assert host_memory.release_freed_host_memory() is False


def test_the_c_library_is_looked_up_once(monkeypatch: pytest.MonkeyPatch, fresh_glibc_lookup: None) -> None:
    """`find_library` starts `ldconfig` in a child process: not at every release."""
    lookups: list[str] = []
    find = host_memory.ctypes.util.find_library
    monkeypatch.setattr(host_memory.ctypes.util, "find_library", lambda name: lookups.append(name) or find(name))
    for _ in range(3):
        host_memory.release_freed_host_memory()
    host_memory.glibc_madvise()
    assert lookups == ["c"]


def test_freed_memory_goes_back() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        pytest.skip("not glibc")
    assert host_memory.release_freed_host_memory()


def test_the_gemm_caches_are_capped_unless_the_environment_says_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in host_memory.GEMM_CACHE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert host_memory.bound_gemm_caches(0) == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "", "LRU_CACHE_CAPACITY": ""}
    assert host_memory.bound_gemm_caches(32) == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "32", "LRU_CACHE_CAPACITY": "32"}
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "8")
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY")
    assert host_memory.bound_gemm_caches(64) == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64", "LRU_CACHE_CAPACITY": "8"}


def test_a_cpu_engine_caps_the_gemm_caches_before_its_first_gemm(monkeypatch: pytest.MonkeyPatch) -> None:
    from services.worker.engine.config import EngineConfig
    from services.worker.wiring import build_engine
    from tests.fixtures.tiny_model import build_model, gemma3_config

    for name in host_memory.GEMM_CACHE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    seen: list[dict[str, str]] = []
    original = host_memory.bound_gemm_caches
    monkeypatch.setattr(host_memory, "bound_gemm_caches", lambda entries: seen.append(original(entries)) or seen[-1])
    build_engine(EngineConfig(model_dir="", num_blocks=16, block_size=4, cpu_gemm_cache_entries=24),
                 model=build_model(gemma3_config()))
    assert seen == [{"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "24", "LRU_CACHE_CAPACITY": "24"}]


def test_the_default_gemm_cache_holds_every_weight_shape_of_one_step() -> None:
    """A cap below a step's distinct weight shapes would make every GEMM of a wide step create
    its primitive again (the LRU evicts each shape before its next layer reads it)."""
    from services.worker.engine.config import EngineConfig
    from services.worker.engine.cpu.linear.cpu_linear import PackedLinear
    from services.worker.wiring import build_engine
    from tests.fixtures.tiny_model import build_model, gemma3_config

    # The default model's projections in small: queries wider than the hidden size, one key/value
    # head, so q, k/v, o, gate/up and down are five shapes, as on Gemma 3 270M.
    model = build_model(gemma3_config(head_dim=32, intermediate_size=192))
    engine = build_engine(EngineConfig(model_dir="", num_blocks=16, block_size=4), model=model)
    shapes = {(module.out_features, module.in_features) for module in engine.model.modules()
              if isinstance(module, PackedLinear)}
    assert len(shapes) == 5
    assert len(shapes) <= EngineConfig(model_dir="").cpu_gemm_cache_entries
