"""Fixtures of the engine tests: the model kinds a module runs on (a module may
override `kind` with its own list) and the transformers reference for each."""

from __future__ import annotations

import pytest
import torch

from tests.unit.worker.engine_helpers import reference_model


@pytest.fixture(scope="module", params=["gemma3", "llama"])
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def reference(kind: str) -> torch.nn.Module:
    return reference_model(kind)
