from __future__ import annotations

from pathlib import Path

import pytest

from common.settings.env import SettingsError
from services.gateway.settings import GatewaySettings


def test_defaults() -> None:
    settings = GatewaySettings.from_env({})
    assert (settings.host, settings.port, settings.grpc_port) == ("127.0.0.1", 8000, 50050)
    assert settings.scheduler_addr == "127.0.0.1:50051"
    assert settings.kvcache_addr == "127.0.0.1:50071"
    assert not settings.tenants.enabled and settings.max_request_bytes == 1024 * 1024
    assert settings.default_max_tokens == 128 and settings.max_model_len == 0
    assert settings.model_id == "gemma-3-270m" and settings.model_names == ("gemma-3-270m",)
    assert settings.tool_call_parser == "hermes"


def test_values_from_env() -> None:
    settings = GatewaySettings.from_env({
        "GATEWAY_PORT": "9000", "API_KEYS": "a, b,", "MAX_REQUEST_BYTES": "4096",
        "MODEL_NAME": "/models/tiny", "MODEL_CACHE_DIR": "/tmp/cache", "LOG_LEVEL": "DEBUG"})
    assert settings.port == 9000
    assert settings.tenants.authenticate(b"b") is not None and len(settings.tenants.tenants) == 2
    assert settings.max_request_bytes == 4096 and settings.model_id == "tiny"   # never the path
    assert settings.model_cache_dir == Path("/tmp/cache") and settings.log_level == "debug"


@pytest.mark.parametrize(("name", "value"), [("GATEWAY_PORT", "http"), ("GATEWAY_PORT", "70000"),
                                             ("MAX_REQUEST_BYTES", "10"), ("LOG_LEVEL", "loud"),
                                             ("DEFAULT_MAX_TOKENS", "0"),
                                             ("TOOL_CALL_PARSER", "llama3_json")])
def test_invalid_values_name_the_variable(name: str, value: str) -> None:
    with pytest.raises(SettingsError, match=name):
        GatewaySettings.from_env({name: value})
