"""CPU_COMPUTE=bfloat16 (bf16_compute.py): refused where it cannot run, the layers' wide
GEMMs in bfloat16 where it can (few rows bit for bit as before, wide ones close to
float32 but not equal), float32 copies dropped where codes and bfloat16 serve every row
count, and the engine's greedy run on the tiny models."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from services.worker.engine.engine import Engine
from services.worker.engine.config import EngineConfig
from services.worker.engine.cpu.linear import bf16_compute
from services.worker.engine.cpu.linear.bf16_compute import (CALIBRATION_ROWS, cpu_flags, first_win, pack_bfloat16,
                                                     require_bfloat16_cpu)
from services.worker.engine.cpu.linear.cpu_linear import PackedLinear, onednn_bf16_packing_available
from services.worker.engine.cpu.kernels.native_build import default_cache_dir
from services.worker.engine.cpu.linear.weight_codes import MAX_ROWS, load_coded_linear
from services.worker.wiring import build_engine
from tests.fixtures.tiny_model import build_model
from tests.unit.worker.engine_helpers import CONFIGS, Driver, RecordingSampler, prompt_of
from tests.unit.worker.test_weight_codes import coded_weight, snap_to_codes

HAS_BF16 = bool(cpu_flags() & set(bf16_compute.BF16_CPU_FLAGS)) and onednn_bf16_packing_available()
needs_bf16 = pytest.mark.skipif(not HAS_BF16, reason="this CPU has no BF16 instructions (avx512_bf16 / amx_bf16)")
MIN_ROWS = 8   # the row count the tests' fake calibration makes bfloat16 win from


def fake_timer(linears: list[PackedLinear], packs: list[torch.Tensor]) -> dict[int, tuple[float, float]]:
    return {rows: (1.0, 0.5 if rows >= MIN_ROWS else 2.0) for rows in CALIBRATION_ROWS}


@pytest.fixture
def calibrated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bf16_compute, "prefill_seconds", lambda linears: (1.0, 0.5))   # bfloat16 pays
    monkeypatch.setattr(bf16_compute, "measure", fake_timer)


def test_the_threshold_is_where_bfloat16_wins_from_on() -> None:
    assert first_win({1: (1, 2), 4: (1, 2), 8: (1, 0.5), 16: (1, 0.5), 32: (1, 0.5)}) == 8
    assert first_win({1: (1, 0.5), 4: (1, 2), 8: (1, 0.5), 32: (1, 0.5)}) == 8    # a win below a loss is not taken
    assert first_win({1: (1, 0.5), 8: (1, 0.5), 32: (1, 0.5)}) == 1
    assert first_win({1: (1, 2), 8: (1, 2), 32: (1, 2), 256: (1, 0.5)}) == 256      # prefill chunks only
    assert first_win({1: (1, 0.5), 8: (1, 0.5), 32: (1, 0.5), 256: (1, 2)}) is None  # slower at a chunk: never


def test_cpu_flags_are_read_from_cpuinfo(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16\n\nprocessor\t: 1\n")
    assert {"avx2", "avx512_bf16"} <= cpu_flags(cpuinfo)
    assert cpu_flags(tmp_path / "missing") == set()


def test_a_cpu_without_bf16_instructions_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="CPU_COMPUTE=bfloat16 needs a CPU with BF16"):
        require_bfloat16_cpu({"avx2", "avx512f"})
    monkeypatch.setattr(bf16_compute, "cpu_flags", lambda: {"avx2", "avx512f"})
    with pytest.raises(ValueError, match="CPU_COMPUTE"):
        _engine(build_model(CONFIGS["gemma3"]()), cpu_compute="bfloat16")


def test_unknown_values_and_other_dtypes_are_refused() -> None:
    with pytest.raises(ValueError, match="CPU_COMPUTE"):
        _engine(build_model(CONFIGS["gemma3"]()), cpu_compute="float16")
    with pytest.raises(ValueError, match="CPU_COMPUTE=bfloat16 applies to a float32 model"):
        _engine(build_model(CONFIGS["gemma3"]()), cpu_compute="bfloat16", dtype="bfloat16")


def test_float32_default_holds_no_bfloat16_packs() -> None:
    engine = _engine(build_model(CONFIGS["gemma3"]()))
    assert engine.prepared.speedups.bfloat16 is None
    assert bf16_compute.holds_bfloat16(engine.prepared.base.modules()) == 0


@needs_bf16
@pytest.mark.parametrize("coded", [False, True])
def test_wide_steps_run_in_bfloat16_and_few_rows_as_before(coded: bool) -> None:
    linear = torch.nn.Linear(128, 96, bias=not coded)
    if coded:
        with torch.no_grad():
            linear.weight.copy_(coded_weight(96, 128))
    packed = PackedLinear(linear, kernel="onednn", max_packed_rows=1 << 62)
    if coded:
        assert packed.use_codes(load_coded_linear(default_cache_dir()), MAX_ROWS)
    generator = torch.Generator().manual_seed(0)
    inputs = {rows: torch.randn(rows, 128, generator=generator) for rows in (1, MIN_ROWS - 1, MIN_ROWS, 100)}
    with torch.no_grad():
        before = {rows: packed(x) for rows, x in inputs.items()}
        packed.use_bfloat16(pack_bfloat16(linear.weight), MIN_ROWS)
        assert packed.drop_float32_weight() == coded      # codes and bfloat16 serve every row count
        for rows, x in inputs.items():
            got = packed(x)
            if rows < MIN_ROWS:
                assert torch.equal(got, before[rows]), rows
            else:
                assert got.dtype == torch.float32 and not torch.equal(got, before[rows])
                torch.testing.assert_close(got, linear(x), atol=0.05, rtol=0.02)
    assert (packed.weight is None and packed.packed is None) == coded
    assert packed.coded_max_rows == (MIN_ROWS - 1 if coded else 0)


@needs_bf16
@pytest.mark.parametrize("codes", [False, True])
def test_the_engine_runs_its_layers_wide_steps_in_bfloat16(calibrated: None, codes: bool) -> None:
    reference = build_model(CONFIGS["gemma3"]())
    if codes:
        snap_to_codes(reference)
    prompts = {"a": prompt_of(40, 1), "b": prompt_of(6, 2), "c": prompt_of(21, 3)}
    runs = {}
    for compute in ("float32", "bfloat16"):
        engine = _engine(reference, cpu_compute=compute)
        recorder = RecordingSampler(engine.sampler)
        engine.sampler = recorder
        runs[compute] = (engine, recorder, Driver(engine).run(prompts, 6, chunk={"c": 8}))
    engine, recorder, tokens = runs["bfloat16"]
    done = engine.prepared.speedups.bfloat16
    layers = reference.config.num_hidden_layers
    assert done is not None and done.min_rows == MIN_ROWS and done.linears == 7 * layers
    assert bf16_compute.holds_bfloat16(engine.prepared.base.modules()) == 7 * layers
    float32_engine = runs["float32"][0]
    float32_dropped = float32_engine.prepared.speedups.dropped_bytes
    assert (engine.prepared.speedups.dropped_bytes > float32_dropped) == codes   # the float32 packs too
    if codes:   # the C decode layers take the decode steps the codes still serve
        assert engine.prepared.speedups.direct.native_layers.max_rows == MIN_ROWS - 1
    assert all(len(tokens[seq_id]) == 6 for seq_id in prompts)
    float32_rows = runs["float32"][1].rows
    differences = [(got - expected).abs().max().item()
                   for (got, seen), (expected, expected_seen) in zip(recorder.rows, float32_rows)
                   if seen == expected_seen]   # the rows of the same tokens, up to where greedy parts
    assert len(differences) >= len(prompts)
    assert max(differences) > 0                # bfloat16 really ran
    assert max(differences) < 0.1              # and stayed close (the tiny models' logits are O(1))



@needs_bf16
@pytest.mark.parametrize("found_by", ["the check before the speed-ups", "the layer calibration"])
def test_where_bfloat16_is_slower_at_a_prefill_chunk_the_worker_runs_float32(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, found_by: str) -> None:
    before = found_by == "the check before the speed-ups"
    monkeypatch.setattr(bf16_compute, "prefill_seconds", lambda linears: (1.0, 2.0 if before else 0.5))
    monkeypatch.setattr(bf16_compute, "measure",
                        lambda linears, packs: {rows: (1.0, 0.5 if rows < 256 else 2.0) for rows in CALIBRATION_ROWS})
    reference = build_model(CONFIGS["gemma3"]())
    snap_to_codes(reference)
    prompts = {"a": prompt_of(40, 1), "b": prompt_of(6, 2)}
    with caplog.at_level("WARNING"):
        engine = _engine(reference, cpu_compute="bfloat16")
    assert engine.prepared.speedups.bfloat16 == bf16_compute.Bfloat16Compute(linears=0, min_rows=None)
    assert bf16_compute.holds_bfloat16(engine.prepared.base.modules()) == 0
    assert "not faster than float32" in caplog.text and "CPU_COMPUTE" in caplog.text
    float32_engine = _engine(reference)
    if before:   # the float32 worker in everything, what it keeps included
        assert engine.prepared.speedups.prefill_weights == float32_engine.prepared.speedups.prefill_weights
        assert engine.prepared.speedups.dropped_bytes == float32_engine.prepared.speedups.dropped_bytes
    assert Driver(engine).run(prompts, 6) == Driver(float32_engine).run(prompts, 6)   # exact

def _engine(model: torch.nn.Module, **config) -> Engine:
    return build_engine(EngineConfig(model_dir="", num_blocks=128, block_size=4, model_key="bf16", **config),
                        model=copy.deepcopy(model))
