from __future__ import annotations

import pytest

from common.block_hash import chain_hashes, prompt_hashes
from common.settings.env import SettingsError
from services.kvcache import convert
from services.kvcache.kv_types import (
    AllCleared, BlockRemoved, BlockStored, IndexStats, KvEvent, LookupResult, PublishBatch,
    PublishResult, WorkerMatch,
)
from services.kvcache.settings import KvCacheSettings


def test_settings_defaults() -> None:
    settings = KvCacheSettings.from_env({})
    assert (settings.port, settings.metrics_port, settings.backend) == (50071, 9103, "memory")
    assert settings.redis_url == "redis://127.0.0.1:6379/0"
    assert (settings.block_size, settings.model_key) == (16, "")


def test_settings_from_env() -> None:
    settings = KvCacheSettings.from_env({
        "KVCACHE_HOST": "0.0.0.0", "KVCACHE_PORT": "6000", "KVCACHE_METRICS_PORT": "0",
        "KV_INDEX_BACKEND": "Redis", "REDIS_URL": "redis://r:1/2", "KV_CACHE_BLOCK_SIZE": "32",
        "MODEL_KEY": "gemma", "LOG_LEVEL": "DEBUG"})
    assert settings == KvCacheSettings(host="0.0.0.0", port=6000, metrics_port=0, backend="redis",
                                       redis_url="redis://r:1/2", block_size=32,
                                       model_key="gemma", log_level="debug")


@pytest.mark.parametrize("name,value", [("KV_INDEX_BACKEND", "disk"), ("KVCACHE_PORT", "x"),
                                        ("KV_CACHE_BLOCK_SIZE", "0")])
def test_invalid_settings_name_the_variable(name: str, value: str) -> None:
    with pytest.raises(SettingsError, match=name):
        KvCacheSettings.from_env({name: value})


def test_prompt_hashes_chain_the_partial_block() -> None:
    tokens = list(range(10))
    hashes = prompt_hashes(tokens, 4, "m")
    assert list(hashes.block_hashes) == chain_hashes(tokens, 4, "m")
    assert hashes.partial_tokens == 2 and hashes.partial_hash not in (0, *hashes.block_hashes)
    assert prompt_hashes(tokens[:8] + [7, 7], 4, "m").partial_hash != hashes.partial_hash
    assert prompt_hashes(tokens, 4, "other").partial_hash != hashes.partial_hash
    assert prompt_hashes(tokens[:8], 4, "m").partial_hash == 0


def test_publish_batch_round_trips_through_proto() -> None:
    batch = PublishBatch("w", (KvEvent(1, BlockStored(0, (5, 6), 9)), KvEvent(2, BlockRemoved((6,))),
                               KvEvent(3, AllCleared())))
    assert convert.publish_from_proto(convert.publish_to_proto(batch)) == batch
    resync = PublishBatch("w", full_resync=True, snapshot=(BlockStored(5, (7,)),), snapshot_seq=4)
    assert convert.publish_from_proto(convert.publish_to_proto(resync)) == resync


def test_results_round_trip_through_proto() -> None:
    result = LookupResult((WorkerMatch("a", 2, 35, True), WorkerMatch("b", 1, 16)), 16)
    assert convert.lookup_result_from_proto(convert.lookup_result_to_proto(result)) == result
    stats = IndexStats(1, 2, 3, 4, 5, 6, 7, {"a": 8}, "redis")
    assert convert.stats_from_proto(convert.stats_to_proto(stats)) == stats
    reply = PublishResult(True, 12)
    assert convert.publish_result_from_proto(convert.publish_result_to_proto(reply)) == reply


def test_redis_password_from_env_or_file_never_shown(tmp_path) -> None:
    assert KvCacheSettings.from_env({}).redis_password == ""
    inline = KvCacheSettings.from_env({"KV_INDEX_REDIS_PASSWORD": "pw-inline-123"})
    assert inline.redis_password == "pw-inline-123" and "pw-inline" not in repr(inline)
    secret = tmp_path / "redis_password"
    secret.write_text("pw-from-file-456\n")
    read = KvCacheSettings.from_env({"KV_INDEX_REDIS_PASSWORD_FILE": str(secret)})
    assert read.redis_password == "pw-from-file-456" and "pw-from-file" not in repr(read)


@pytest.mark.parametrize("content,env,message", [
    (None, {"KV_INDEX_REDIS_PASSWORD": "pw-secret-1"}, "both set"),
    ("", {}, "one non-empty line"),
    ("pw-secret-1\nmore", {}, "one non-empty line"),
    ("pw-secret-1", {"REDIS_URL": "redis://:pw-secret-2@r:6379/0"}, "give it once"),
])
def test_bad_redis_password_settings_name_the_variable_not_the_value(
        tmp_path, content: str | None, env: dict[str, str], message: str) -> None:
    path = tmp_path / "redis_password"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SettingsError, match=message) as error:
        KvCacheSettings.from_env({"KV_INDEX_REDIS_PASSWORD_FILE": str(path), **env})
    assert "KV_INDEX_REDIS_PASSWORD" in str(error.value) and "pw-secret" not in str(error.value)
