"""The container files, read statically (no Docker here): every variable the
compose files set is one a service reads, and the GPU overlay only swaps the
worker's image and device."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from loadsim.__main__ import parse_args

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
FAIRSERVE_SERVICES = ("kvcache", "scheduler", "worker", "gateway")


def _compose(name: str) -> dict:
    return yaml.safe_load((DEPLOY / name).read_text())


def _variables_read_by_settings() -> set[str]:
    names: set[str] = set()
    for path in [ROOT / "common" / "settings.py", ROOT / "common" / "internal_auth.py",
                 *ROOT.glob("services/*/settings.py")]:
        names.update(re.findall(r'"([A-Z][A-Z0-9_]+)"', path.read_text()))
    return names


def test_every_service_runs_a_module_that_exists() -> None:
    services = _compose("compose.yaml")["services"]
    for name in FAIRSERVE_SERVICES:
        command = services[name]["command"]
        assert command[:2] == ["python", "-m"]
        assert (ROOT / (command[2].replace(".", "/") + ".py")).is_file(), command


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
    assert worker["image"] != base["gateway"]["image"]      # the other services keep the CPU image
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
    gateway_port = services["gateway"]["ports"][0].split(":")[1]
    assert command[command.index("--url") + 1] == f"http://gateway:{gateway_port}"
    assert "--wait" in command and loadsim["depends_on"] == ["gateway"]
    args = parse_args(command[3:])
    assert args.wait > 0 and args.users > 0


def test_every_long_running_service_restarts_when_it_exits() -> None:
    for name, spec in _compose("compose.yaml")["services"].items():
        expected = ("no",) if "load" in spec.get("profiles", ()) else ("unless-stopped", "on-failure")
        assert spec.get("restart") in expected, (name, spec.get("restart"))
