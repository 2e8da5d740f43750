"""The `fairserve` command (fairserve/cli/): its commands, every setting as a flag with its
variable, type, default and meaning, `config` with secrets masked, `--config` YAML, errors that
name the setting, and docs/config.md generated from the same schemas."""

from __future__ import annotations

import subprocess
import sys

from pathlib import Path

import pytest

from common.transport.internal_auth import InternalAuth
from fairserve.cli import schemas as registry
from fairserve.cli.main import main
from fairserve.cli.reference import render
from fairserve.launcher.stack import ROOT
from services.gateway.settings import GatewaySettings
from services.kvcache.settings import KvCacheSettings
from services.scheduler.settings import SchedulerSettings
from services.worker.settings import WorkerSettings

SECRET_KEY = "sk-alice-0123456789abcdef"


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as stop:
        code = stop.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in [*registry.schemas_for("run")[0].variables()] + [
            v for schema in registry.SERVICES.values() for v in schema.variables()]:
        monkeypatch.delenv(variable, raising=False)


def test_help_lists_every_command(capsys) -> None:
    code, out, _ = _run(capsys, "--help")
    assert code == 0
    for command in ("run", "gateway", "scheduler", "worker", "kvcache", "config", "version"):
        assert f"    {command}" in out


def test_service_help_shows_each_setting_as_flag_and_variable_with_type_and_default(capsys) -> None:
    code, out, _ = _run(capsys, "worker", "--help")
    assert code == 0
    assert "--kv-cache-num-blocks INT" in out and "[KV_CACHE_NUM_BLOCKS] int >= 0, default 0:" in out
    assert "--model-name" in out and "[MODEL_NAME]" in out
    assert "worker advanced settings" in out and "--cpu-linear-kernel" in out
    code, out, _ = _run(capsys, "run", "--help")
    for variable in ("GATEWAY_PORT", "SCHEDULING_POLICY", "KV_CACHE_NUM_BLOCKS", "REDIS_URL", "LOG_DIR"):
        assert f"[{variable}]" in out


def test_every_setting_a_service_reads_is_declared_in_its_schema() -> None:
    """A variable read at start but missing from the schema would have no flag and no docs."""
    class Recorder(dict):
        def __init__(self) -> None:
            super().__init__()
            self.read: set[str] = set()

        def get(self, key, default=None):
            self.read.add(key)
            return super().get(key, default)

        def __getitem__(self, key):
            self.read.add(key)
            return super().__getitem__(key)

    builders = {"gateway": GatewaySettings.from_env, "scheduler": SchedulerSettings.from_env,
                "worker": WorkerSettings.from_env, "kvcache": KvCacheSettings.from_env}
    for service, build in builders.items():
        env = Recorder()
        build(env)
        declared = set(registry.SERVICES[service].variables())
        assert env.read and env.read <= declared, (service, sorted(env.read - declared))
    env = Recorder()
    InternalAuth.from_env(env)
    assert env.read <= set(registry.SERVICES["kvcache"].variables())


def test_config_prints_effective_values_and_never_a_secret(capsys, monkeypatch) -> None:
    monkeypatch.setenv("API_KEYS", f"alice={SECRET_KEY}")
    monkeypatch.setenv("INTERNAL_TOKEN", "internal-secret-0123456789")
    monkeypatch.setenv("REDIS_URL", "redis://user:hunter2-pass@redis:6379/0")
    monkeypatch.setenv("MAX_BATCH_SIZE", "7")
    code, out, _ = _run(capsys, "config")
    assert code == 0
    for secret in (SECRET_KEY, "internal-secret", "hunter2"):
        assert secret not in out
    assert "API_KEYS=********" in out and "INTERNAL_TOKEN=********" in out
    assert "REDIS_URL=redis://user:********@redis:6379/0" in out
    assert "MAX_BATCH_SIZE=7" in out
    assert [line for line in out.splitlines() if line.startswith("# ")] == [
        "# run", "# gateway", "# scheduler", "# worker", "# kvcache"]
    code, out, _ = _run(capsys, "config", "scheduler", "--max-batch-size", "9")
    assert code == 0 and out.startswith("# scheduler\n") and "MAX_BATCH_SIZE=9" in out


def test_bad_values_and_unknown_flags_are_errors_naming_the_setting(capsys, monkeypatch) -> None:
    code, _, err = _run(capsys, "worker", "--kv-cache-num-blocks", "-1")
    assert code == 2
    assert "KV_CACHE_NUM_BLOCKS=-1 is invalid: must be at least 0 (flag --kv-cache-num-blocks)" in err
    code, _, err = _run(capsys, "scheduler", "--scheduling-policy", "fastest")
    assert code == 2 and "SCHEDULING_POLICY='fastest' is invalid: expected one of fcfs, vtc, auto" in err
    monkeypatch.setenv("MAX_QUEUE_LEN", "many")
    code, _, err = _run(capsys, "config", "scheduler")
    assert code == 2 and "MAX_QUEUE_LEN='many' is invalid: expected an integer" in err
    code, _, err = _run(capsys, "worker", "--no-such-setting", "1")
    assert code == 2 and "unrecognized arguments: --no-such-setting" in err
    monkeypatch.setenv("API_KEYS", SECRET_KEY)
    code, _, err = _run(capsys, "config", "gateway", "--max-request-bytes", "1")
    assert code == 2 and "MAX_REQUEST_BYTES" in err and SECRET_KEY not in err


def test_a_config_file_sits_under_the_environment_and_the_flags(capsys, monkeypatch, tmp_path) -> None:
    config = tmp_path / "fairserve.yaml"
    config.write_text("max-batch-size: 5\nMAX_QUEUE_LEN: 11\nqueue_timeout_s: 2.5\n"
                      "async_scheduling: false\n")
    monkeypatch.setenv("MAX_QUEUE_LEN", "12")
    code, out, _ = _run(capsys, "config", "scheduler", "--config", str(config), "--queue-timeout-s", "3")
    assert code == 0
    assert "MAX_BATCH_SIZE=5" in out and "MAX_QUEUE_LEN=12" in out and "QUEUE_TIMEOUT_S=3.0" in out
    assert "ASYNC_SCHEDULING=false" in out
    config.write_text("max_batch_sise: 5\n")
    code, _, err = _run(capsys, "config", "scheduler", "--config", str(config))
    assert code == 2 and "unknown setting 'max_batch_sise'" in err
    config.write_text("- a list\n")
    code, _, err = _run(capsys, "config", "scheduler", "--config", str(config))
    assert code == 2 and "expected a mapping" in err


def test_version(capsys) -> None:
    code, out, _ = _run(capsys, "version")
    assert code == 0 and out.startswith("fairserve ") and out.strip() != "fairserve 0+unknown"


def test_the_console_script_runs_from_any_directory(tmp_path: Path) -> None:
    script = Path(sys.executable).parent / "fairserve"
    if not script.exists():
        pytest.skip("the package is not installed in this environment (make install does)")
    result = subprocess.run([str(script), "kvcache", "--help"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0 and "[KV_INDEX_BACKEND]" in result.stdout


def test_docs_config_page_is_generated_from_the_schemas() -> None:
    page = (ROOT / "docs" / "config.md").read_text(encoding="utf-8")
    assert page == render(), "docs/config.md is stale: run `make config-docs`"
    for schema in [*registry.SERVICES.values(), registry.RUN]:
        for variable, field in schema.variables().items():
            assert f"`{variable}`" in page
            assert field.description and "TODO" not in field.description, variable
