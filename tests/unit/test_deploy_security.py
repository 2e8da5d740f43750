"""deploy/compose.yaml hardened, read statically: every container drops all
capabilities and cannot gain privileges, has a memory limit, runs on a
read-only root with tmpfs where it writes (Grafana excepted: it keeps its
state on its root filesystem); only the proxy publishes on every interface;
Redis requires the password of a secret that only it and the kvcache hold.
The Redis start and health commands of compose and Kubernetes run here
against a real redis-server (skipped without one), quoting included."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
OURS = ("kvcache", "scheduler", "worker", "gateway", "proxy", "loadsim")
PASSWORD = "0123456789abcdef0123456789abcdef"


def services() -> dict[str, dict]:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]


def test_every_container_drops_capabilities_and_privileges_and_has_a_memory_limit() -> None:
    for name, spec in services().items():
        assert spec["cap_drop"] == ["ALL"], name
        assert "no-new-privileges:true" in spec["security_opt"], name
        assert spec["deploy"]["resources"]["limits"]["memory"], name
        assert "privileged" not in spec and "cap_add" not in spec, name
    gpu = yaml.safe_load((DEPLOY / "compose.gpu.yaml").read_text())["services"]["worker"]
    assert gpu["deploy"]["resources"]["limits"]["memory"]


def test_read_only_roots_with_tmpfs_where_they_write() -> None:
    for name, spec in services().items():
        if name == "grafana":
            assert "read_only" not in spec
            continue
        assert spec["read_only"] is True, name
        mounts = {entry.split(":", 1)[0]: entry.partition(":")[2].split(",") for entry in spec["tmpfs"]}
        if name in OURS:
            assert "mode=1777" in mounts["/tmp"], name
            # compiled CPU kernels are loaded from the cache: it must allow exec
            assert {"exec", "mode=1777"} <= set(mounts["/home/fairserve/.cache"]), name
    assert "/prometheus" in services()["prometheus"]["tmpfs"][0]


def test_only_the_proxy_publishes_beyond_this_host() -> None:
    for name, spec in services().items():
        for port in spec.get("ports", []):
            if name == "proxy":
                assert not port.startswith("127.0.0.1:"), port       # the public entry point
            else:
                assert port.startswith("127.0.0.1:"), (name, port)
    assert {name for name, spec in services().items() if spec.get("ports")} == {
        "proxy", "prometheus", "grafana"}


def test_the_redis_password_comes_from_a_secret_only_redis_and_the_kvcache_hold() -> None:
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    secret = (DEPLOY / compose["secrets"]["redis_password"]["file"]).resolve()
    assert secret.parent == DEPLOY / "secrets"                  # git-ignored, never in the image
    holders = {name for name, spec in compose["services"].items()
               if "redis_password" in spec.get("secrets", [])}
    assert holders == {"redis", "kvcache"}
    kvcache = compose["services"]["kvcache"]["environment"]
    assert kvcache["KV_INDEX_REDIS_PASSWORD_FILE"] == "/run/secrets/redis_password"
    assert "KV_INDEX_REDIS_PASSWORD" not in kvcache and "@" not in kvcache["REDIS_URL"]
    redis_spec = compose["services"]["redis"]
    assert redis_spec["user"] == "999:1000"                     # no root entrypoint step
    assert "/run/secrets/redis_password" in redis_spec["command"][2]


# ---- the commands, run ----

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def compose_script(text: str, secret: Path, workdir: Path, port: int) -> str:
    """A compose command as the shell in the container gets it ($$ is compose's
    escape for $), with the container's paths and port moved to the test's."""
    return (text.replace("$$", "$").replace("/run/secrets/redis_password", str(secret))
            .replace("/tmp/redis.conf", str(workdir / "redis.conf"))
            .replace("redis-cli ping", f"redis-cli -p {port} ping")
            + (f" --port {port} --bind 127.0.0.1" if "redis-server" in text else ""))


@pytest.fixture
def redis_binaries() -> None:
    if not (shutil.which("redis-server") and shutil.which("redis-cli")):
        pytest.skip("redis-server and redis-cli are not installed")


@contextlib.contextmanager
def run_redis(script: str, env: dict[str, str], port: int) -> Iterator[subprocess.Popen]:
    process = subprocess.Popen(["sh", "-c", script], env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", port)) == 0:
                    break
            assert process.poll() is None and time.monotonic() < deadline, "redis did not start"
            time.sleep(0.05)
        yield process
    finally:
        process.terminate()
        process.wait(timeout=10)


def assert_requires_the_password(port: int) -> None:
    with redis.Redis(port=port, password=PASSWORD) as client:
        assert client.ping() is True
    with redis.Redis(port=port) as client, pytest.raises(redis.AuthenticationError):
        client.ping()


@pytest.mark.usefixtures("redis_binaries")
def test_compose_redis_starts_with_the_secret_and_its_healthcheck_needs_it(tmp_path: Path) -> None:
    spec = services()["redis"]
    secret, port = tmp_path / "redis_password", free_port()
    secret.write_text(PASSWORD + "\n")
    start = compose_script(spec["command"][2], secret, tmp_path, port)
    health = compose_script(spec["healthcheck"]["test"][3], secret, tmp_path, port)
    assert spec["healthcheck"]["test"][:3] == ["CMD", "sh", "-c"]
    with run_redis(start, {"PATH": "/usr/bin:/bin:/usr/local/bin"}, port) as process:
        assert_requires_the_password(port)
        assert PASSWORD not in " ".join(process.args)       # argv holds the file's path only
        assert (tmp_path / "redis.conf").stat().st_mode & 0o077 == 0
        assert subprocess.run(["sh", "-c", health], timeout=10).returncode == 0
        secret.write_text("wrong-password\n")
        assert subprocess.run(["sh", "-c", health], timeout=10).returncode != 0


@pytest.mark.usefixtures("redis_binaries")
def test_kubernetes_redis_starts_with_the_secret_and_its_probe_needs_it(tmp_path: Path) -> None:
    deployment = next(yaml.safe_load_all((DEPLOY / "k8s" / "base" / "redis.yaml").read_text()))
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    port = free_port()
    start = compose_script(container["command"][2], tmp_path / "unused", tmp_path, port)
    probe = compose_script(container["readinessProbe"]["exec"]["command"][2], tmp_path, tmp_path, port)
    env = {"PATH": "/usr/bin:/bin:/usr/local/bin", "REDISCLI_AUTH": PASSWORD}
    with run_redis(start, env, port):
        assert_requires_the_password(port)
        assert subprocess.run(["sh", "-c", probe], env=env, timeout=10).returncode == 0
        wrong = {**env, "REDISCLI_AUTH": "wrong-password"}
        assert subprocess.run(["sh", "-c", probe], env=wrong, timeout=10).returncode != 0
