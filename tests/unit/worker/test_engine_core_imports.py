"""Dependencies one way: the engine core imports nothing from engine/cpu or engine/cuda (the
device speed-ups are plugged in from outside, engine/accelerators.py), and the two device
packages import each other nowhere. Every import counts: at the top, inside a function, under
TYPE_CHECKING, relative, or through importlib with a constant name. And the core imports,
builds an engine and serves greedy tokens with both packages unimportable."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
ENGINE = ROOT / "services" / "worker" / "engine"
PACKAGE = "services.worker.engine"
CPU, CUDA = f"{PACKAGE}.cpu", f"{PACKAGE}.cuda"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def core_files() -> list[Path]:
    device = (ENGINE / "cpu", ENGINE / "cuda")
    return sorted(p for p in ENGINE.rglob("*.py") if not any(p.is_relative_to(d) for d in device))


def imported_names(source: str, module: str, is_package: bool) -> set[str]:
    """Every module `source` (of `module`) names in an import statement anywhere, or through
    importlib.import_module / __import__ with a constant string."""
    package = module if is_package else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            function = node.func
            called = function.attr if isinstance(function, ast.Attribute) else getattr(function, "id", "")
            if called in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                names.add(node.args[0].value)
    return names


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def offending(files: list[Path], forbidden: tuple[str, ...]) -> list[str]:
    found = []
    for path in files:
        module = module_name(path)
        for name in imported_names(path.read_text(), module, path.name == "__init__.py"):
            if any(within(name, package) for package in forbidden):
                found.append(f"{path.relative_to(ROOT)} imports {name}")
    return sorted(found)


def test_the_core_is_every_engine_module_outside_cpu_and_cuda() -> None:
    names = {module_name(p) for p in core_files()}
    assert {f"{PACKAGE}.engine", f"{PACKAGE}.step.forward", f"{PACKAGE}.model",
            f"{PACKAGE}.sampling.sampling", f"{PACKAGE}.step.attention", f"{PACKAGE}.kv.block_pool",
            f"{PACKAGE}.accelerators", f"{PACKAGE}.lora.layers"} <= names
    assert not any(within(name, CPU) or within(name, CUDA) for name in names)


def test_no_core_module_imports_cpu_or_cuda() -> None:
    assert offending(core_files(), (CPU, CUDA)) == []


def test_cpu_and_cuda_do_not_import_each_other() -> None:
    assert offending(sorted((ENGINE / "cpu").rglob("*.py")), (CUDA,)) == []
    assert offending(sorted((ENGINE / "cuda").rglob("*.py")), (CPU,)) == []


@pytest.mark.parametrize("source", [
    "def load():\n    from services.worker.engine.cpu.kernels.native_decode import load_decode_kernel\n",
    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from services.worker.engine.cuda import decode_graphs\n",
    "import services.worker.engine.cuda.varlen_attention as varlen\n",
    "from services.worker.engine import cpu\n",
    "from .cpu.speedups import apply_speedups\n",
    "from . import cuda\n",
    "import importlib\nspeedups = importlib.import_module('services.worker.engine.cpu.speedups')\n",
])
def test_the_check_sees_every_kind_of_import(source: str) -> None:
    names = imported_names(source, f"{PACKAGE}.model", is_package=False)
    assert any(within(name, CPU) or within(name, CUDA) for name in names), names


def test_the_core_serves_without_cpu_and_cuda() -> None:
    """In a fresh interpreter where neither package can be imported: every core module
    imports, and an engine with no accelerators serves transformers' greedy tokens."""
    modules = [module_name(p) for p in core_files()]
    script = f"""
import importlib, sys

class Refuse:
    def find_spec(self, name, path=None, target=None):
        if any(name == p or name.startswith(p + ".") for p in ({CPU!r}, {CUDA!r})):
            raise ImportError("device speed-ups unavailable: " + name)
        return None

sys.meta_path.insert(0, Refuse())
for module in {modules!r}:
    importlib.import_module(module)

import torch
from common.step import NewSequence, StepBatch, WorkItem
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from tests.fixtures.tiny_model import build_model, gemma3_config

engine = Engine(EngineConfig(model_dir="", num_blocks=32, block_size=4, model_key="core"),
                model=build_model(gemma3_config()))
assert (engine.attention_kernel, engine.decode_attention, engine.direct_forward) == ("sdpa", "sdpa", "transformers")
assert not engine.lm_head_screened and engine.graphs is None and engine.linear_kernel is None
prompt = [2, 17, 33, 48, 5, 91, 12]
got, batch = [], StepBatch(new_sequences=[NewSequence("a", prompt)], work=[WorkItem("a", 3)])
while len(got) < 6:
    (result,) = engine.step(batch).results
    assert not result.error, result
    if result.sampled:
        got += [result.token_id, *result.more_token_ids]
    batch = StepBatch(work=[WorkItem("a", 3)])
ids = torch.tensor([prompt])
expected = build_model(gemma3_config()).generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                                                 do_sample=False)[0, len(prompt):].tolist()
assert got[:len(expected)] == expected, (got, expected)
assert not any(name == {CPU!r} or name.startswith({CPU!r} + ".") or name == {CUDA!r}
               or name.startswith({CUDA!r} + ".") for name in sys.modules)
print("served", got)
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "served" in done.stdout
