"""Every service builds its settings from env and names the bad variable."""

from __future__ import annotations

import pytest

from common.settings.env import EnvReader, SettingsError
from services.worker.engine.config import EngineConfig
from services.worker.settings import WorkerSettings, engine_config_from_env
from services.scheduler.settings import SchedulerSettings


def test_reader_names_the_variable() -> None:
    read = EnvReader({"MAX_BATCH_SIZE": "lots", "DEVICE": "tpu", "FLAG": "maybe", "N": "-3"})
    with pytest.raises(SettingsError, match="MAX_BATCH_SIZE"):
        read.int("MAX_BATCH_SIZE", 8)
    with pytest.raises(SettingsError, match="DEVICE='tpu'.*auto, cpu"):
        read.choice("DEVICE", "auto", ("auto", "cpu"))
    with pytest.raises(SettingsError, match="FLAG"):
        read.bool("FLAG", False)
    with pytest.raises(SettingsError, match="N=-3.*at least 1"):
        read.int("N", 1, minimum=1)


def test_reader_defaults_and_blank_values() -> None:
    read = EnvReader({"EMPTY": "  ", "LIST": "a, b,,c"})
    assert read.int("EMPTY", 7) == 7
    assert read.list("LIST") == ("a", "b", "c")
    assert read.float("MISSING", 0.5) == 0.5


def test_worker_settings_defaults_and_errors() -> None:
    settings = WorkerSettings.from_env({})
    assert settings.port == 50061 and settings.engine.block_size == 16 and settings.engine.device == "auto"
    with pytest.raises(SettingsError, match="KV_CACHE_BLOCK_SIZE"):
        WorkerSettings.from_env({"KV_CACHE_BLOCK_SIZE": "0"})
    with pytest.raises(SettingsError, match="DEVICE"):
        WorkerSettings.from_env({"DEVICE": "gpu"})
    with pytest.raises(SettingsError, match="EVICTION_POLICY"):
        WorkerSettings.from_env({"EVICTION_POLICY": "random"})
    assert settings.engine.eviction_policy == "lru"
    assert WorkerSettings.from_env({"EVICTION_POLICY": "lfu"}).engine.eviction_policy == "lfu"


def test_worker_cuda_graph_settings() -> None:
    engine = WorkerSettings.from_env({}).engine
    assert engine.use_cuda_graphs and engine.cuda_graph_max_batch == 64
    assert engine.cuda_graph_max_context == 8192
    engine = WorkerSettings.from_env({"USE_CUDA_GRAPHS": "false", "CUDA_GRAPH_MAX_BATCH": "16"}).engine
    assert not engine.use_cuda_graphs and engine.cuda_graph_max_batch == 16
    with pytest.raises(SettingsError, match="CUDA_GRAPH_MAX_BATCH"):
        WorkerSettings.from_env({"CUDA_GRAPH_MAX_BATCH": "0"})


@pytest.mark.parametrize("variable,field,default,other,bad", [
    ("ATTENTION_BACKEND", "attention_backend", "auto", "sdpa", "xformers"),
    ("CPU_LINEAR_KERNEL", "cpu_linear_kernel", "auto", "onednn", "openblas"),
    ("CPU_NATIVE_KERNELS", "cpu_native_kernels", "auto", "off", "on"),
    ("DIRECT_FORWARD", "direct_forward", "auto", "off", "on"),
    ("CPU_WEIGHT_CODES", "cpu_weight_codes", "auto", "off", "on"),
    ("DECODE_ATTENTION", "decode_attention", "auto", "sdpa", "paged"),
    ("CPU_COMPUTE", "cpu_compute", "float32", "bfloat16", "float16"),
    ("CPU_PREFILL_WEIGHTS", "cpu_prefill_weights", "auto", "packs", "pack"),
    ("CPU_PREFILL_GEMM", "cpu_prefill_gemm", "auto", "native", "onednn"),
    ("GRAMMAR_TOKENIZER", "grammar_tokenizer", "first_use", "start", "lazy"),
])
def test_worker_kernel_choice_settings(variable: str, field: str, default: str, other: str, bad: str) -> None:
    assert getattr(WorkerSettings.from_env({}).engine, field) == default
    assert getattr(WorkerSettings.from_env({variable: other}).engine, field) == other
    with pytest.raises(SettingsError, match=variable):
        WorkerSettings.from_env({variable: bad})


def test_worker_lm_head_screen_settings() -> None:
    assert WorkerSettings.from_env({}).engine.lm_head_screen == "auto"
    assert WorkerSettings.from_env({"LM_HEAD_SCREEN": "off"}).engine.lm_head_screen == "off"
    with pytest.raises(SettingsError, match="LM_HEAD_SCREEN"):
        WorkerSettings.from_env({"LM_HEAD_SCREEN": "maybe"})
    assert WorkerSettings.from_env({"LM_HEAD_SCREEN_MAX_ROWS": "12"}).engine.lm_head_screen_max_rows == 12
    assert WorkerSettings.from_env({}).engine.lm_head_screen_max_rows == 0      # by the screen's kernel
    assert WorkerSettings.from_env({}).engine.lm_head_screen_weights == "auto"
    assert WorkerSettings.from_env({"LM_HEAD_SCREEN_WEIGHTS": "copy"}).engine.lm_head_screen_weights == "copy"
    with pytest.raises(SettingsError, match="LM_HEAD_SCREEN_WEIGHTS"):
        WorkerSettings.from_env({"LM_HEAD_SCREEN_WEIGHTS": "codes"})
    with pytest.raises(SettingsError, match="LM_HEAD_SCREEN_MAX_ROWS"):
        WorkerSettings.from_env({"LM_HEAD_SCREEN_MAX_ROWS": "-1"})
    assert WorkerSettings.from_env({}).engine.lm_head_screen_activations == "auto"
    assert WorkerSettings.from_env({}).engine.cpu_gemm_cache_entries == 8
    assert WorkerSettings.from_env({"CPU_GEMM_CACHE_ENTRIES": "0"}).engine.cpu_gemm_cache_entries == 0
    with pytest.raises(SettingsError, match="CPU_GEMM_CACHE_ENTRIES"):
        WorkerSettings.from_env({"CPU_GEMM_CACHE_ENTRIES": "-3"})
    assert WorkerSettings.from_env({"LM_HEAD_SCREEN_ACTIVATIONS": "int8"}).engine.lm_head_screen_activations == "int8"
    with pytest.raises(SettingsError, match="LM_HEAD_SCREEN_ACTIVATIONS"):
        WorkerSettings.from_env({"LM_HEAD_SCREEN_ACTIVATIONS": "int4"})


def test_speculative_decoding_settings() -> None:
    core = SchedulerSettings.from_env({}).core_config()     # up to 2 greedy streams draft by default
    assert (core.speculative_tokens, core.speculative_max_batch, core.speculative_sampled) == (4, 2, False)
    assert SchedulerSettings.from_env({"SPECULATIVE_TOKENS": "0"}).core_config().speculative_tokens == 0
    assert SchedulerSettings.from_env({"SPECULATIVE_SAMPLED": "true"}).core_config().speculative_sampled
    with pytest.raises(SettingsError, match="SPECULATIVE_SAMPLED"):
        SchedulerSettings.from_env({"SPECULATIVE_SAMPLED": "sometimes"})
    scheduler = SchedulerSettings.from_env({"SPECULATIVE_TOKENS": "4", "SPECULATIVE_MAX_BATCH": "2"})
    assert (scheduler.core_config().speculative_tokens, scheduler.core_config().speculative_max_batch) == (4, 2)
    with pytest.raises(SettingsError, match="SPECULATIVE_TOKENS"):
        SchedulerSettings.from_env({"SPECULATIVE_TOKENS": "-1"})
    engine = WorkerSettings.from_env({"SPECULATIVE_NGRAM_MIN": "1", "SPECULATIVE_NGRAM_MAX": "3"}).engine
    assert (engine.ngram_min, engine.ngram_max) == (1, 3)
    with pytest.raises(SettingsError, match="SPECULATIVE_NGRAM_MIN=5 is invalid"):
        WorkerSettings.from_env({"SPECULATIVE_NGRAM_MIN": "5"})


def test_worker_settings_hold_the_engine_config_with_the_model_dir_left_for_start() -> None:
    settings = WorkerSettings.from_env({"MODEL_KEY": "gemma", "KV_CACHE_NUM_BLOCKS": "128", "DTYPE": "float32",
                                        "MODEL_NAME": "org/model"})
    assert settings.model_name == "org/model"
    assert settings.engine == EngineConfig(model_dir="", model_key="gemma", num_blocks=128, dtype="float32")
    assert engine_config_from_env({"MODEL_KEY": "gemma", "KV_CACHE_NUM_BLOCKS": "128",
                                   "DTYPE": "float32"}) == settings.engine
    with pytest.raises(SettingsError, match="SPECULATIVE_NGRAM_MAX"):
        engine_config_from_env({"SPECULATIVE_NGRAM_MAX": "17"})


@pytest.mark.parametrize("hostname", ["3f2a9c1b7d4e", "node-7.example.org", "bad host/ü_name", "-" * 5, "h" * 300])
def test_worker_id_default_is_unique_per_host_and_valid_for_the_scheduler(monkeypatch, hostname: str) -> None:
    """Replicas in containers are all PID 1: the hostname tells them apart."""
    import os
    import socket

    from services.scheduler.workers.registration import check_worker_id

    monkeypatch.setattr(socket, "gethostname", lambda: hostname)
    worker_id = WorkerSettings.from_env({}).worker_id
    check_worker_id(worker_id)
    assert worker_id.startswith("worker-") and worker_id.endswith(f"-{os.getpid()}")
    monkeypatch.setattr(socket, "gethostname", lambda: "x" + hostname)
    assert WorkerSettings.from_env({}).worker_id != worker_id
    assert WorkerSettings.from_env({"WORKER_ID": "w-7"}).worker_id == "w-7"
