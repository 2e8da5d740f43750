"""The multi-LoRA serving benchmark's pure parts: the adapters' shapes from a model's config,
what each system is started with to serve them all, requests naming the adapters in turn, and
the table against base only."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.head_to_head.sweep import Plan
from benchmarks.head_to_head.systems import Served
from benchmarks.lora_serving import AdapterDriver, adapter_settings, projection_shapes, table


def test_shapes_are_every_layers_q_and_v_projections(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({
        "hidden_size": 640, "head_dim": 256, "num_attention_heads": 4, "num_key_value_heads": 1,
        "num_hidden_layers": 2}))
    assert projection_shapes(tmp_path) == {
        "model.layers.0.self_attn.q_proj": (640, 1024), "model.layers.0.self_attn.v_proj": (640, 256),
        "model.layers.1.self_attn.q_proj": (640, 1024), "model.layers.1.self_attn.v_proj": (640, 256)}


def test_each_system_starts_with_every_adapter_resident() -> None:
    adapters = {"a0": Path("/l/a0"), "a1": Path("/l/a1")}
    env, args = adapter_settings("fairserve", adapters)
    assert env == {"LORA_MODULES": "a0=/l/a0,a1=/l/a1", "MAX_LORAS": "2", "MAX_LORA_RANK": "8"} and args == ()
    env, args = adapter_settings("vllm", adapters)
    assert env == {} and args == ("--enable-lora", "--max-loras", "2", "--max-lora-rank", "8",
                                  "--lora-modules", "a0=/l/a0", "a1=/l/a1")


def test_requests_name_the_adapters_in_turn() -> None:
    driver = AdapterDriver("fairserve", Served("http://127.0.0.1:1", "base"), Plan(), ["a0", "a1"])
    models = [driver._planned("p", 4, "t").body["model"] for _ in range(3)]
    assert models == ["a0", "a1", "a0"]


def test_the_table_quotes_each_configuration_against_base_only() -> None:
    rates = {"base only": {8: [100.0, 90.0, 110.0]}, "4 adapters": {8: [80.0, 85.0, 70.0]}}
    lines = table("fairserve", "LORA_MODULES=a0", rates)
    assert "| base only | 8 | 100.0 | 1.00x | 100.0 / 90.0 / 110.0 |" in lines
    assert "| 4 adapters | 8 | 80.0 | 0.80x | 80.0 / 85.0 / 70.0 |" in lines
