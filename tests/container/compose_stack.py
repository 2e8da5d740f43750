"""deploy/compose.yaml run the way a user runs it: the images built by `make
image`, the stack brought up by docker compose or podman-compose, containers
found by the labels compose puts on them, everything removed at the end."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
# Written by the shared tool that prepares podman on machines without a
# registry (../shared/tools/container-runtime.sh): torch's CPU wheel and a
# pip.conf whose find-links names it, since download.pytorch.org is out of reach.
LOCAL_WHEELS = Path("/opt/wheels")
LOCAL_PIP_CONF = Path("/etc/containers/build-pip.conf")


@dataclass(frozen=True)
class Runtime:
    engine: str                    # the container command: docker or podman
    compose: tuple[str, ...]       # the compose command in front of -p/-f


def _answers(*command: str) -> bool:
    try:
        return subprocess.run(command, capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def find_runtime() -> tuple[Runtime | None, str]:
    """docker with its compose plugin where its daemon answers, else podman with
    podman-compose; or None and the reason the container tests skip (also when CI says
    that preparing the runtime failed, in FAIRSERVE_CONTAINER_SKIP)."""
    if os.environ.get("FAIRSERVE_CONTAINER_SKIP"):
        return None, os.environ["FAIRSERVE_CONTAINER_SKIP"]
    if shutil.which("docker") and _answers("docker", "info") and _answers("docker", "compose", "version"):
        return Runtime("docker", ("docker", "compose")), ""
    if shutil.which("podman") and shutil.which("podman-compose") and _answers("podman", "info"):
        return Runtime("podman", ("podman-compose",)), ""
    return None, ("no container runtime: neither docker (daemon and compose plugin) nor podman with "
                  "podman-compose is usable here (CI prepares podman with "
                  "../shared/tools/container-runtime.sh when that tool exists)")


def make_image_command(runtime: Runtime) -> list[str]:
    """`make image` with the runtime's command, and on a machine without
    download.pytorch.org (podman prepared by the shared tool) the local wheels."""
    command = ["make", "image", f"CONTAINER={runtime.engine}"]
    if runtime.engine == "podman" and LOCAL_PIP_CONF.is_file() and LOCAL_WHEELS.is_dir():
        command += ["TORCH_INDEX_URL=", f"BUILD_FLAGS=-v {LOCAL_WHEELS}:{LOCAL_WHEELS}:ro "
                                        f"-v {LOCAL_PIP_CONF}:/etc/pip.conf:ro"]
    return command


def run(command: list[str], timeout: float, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, **kwargs)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(command)} exited {result.returncode}\n"
                             f"{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
    return result


@dataclass
class ComposeStack:
    runtime: Runtime
    project: str
    compose_file: Path
    env: dict[str, str]
    url: str = ""                  # the proxy, the published entry point
    prometheus: str = ""
    log: list[str] = field(default_factory=list)

    def compose(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess:
        command = [*self.runtime.compose, "-p", self.project, "-f", str(self.compose_file), *args]
        self.log.append(" ".join(command))
        return run(command, timeout, check=check, env=self.env, cwd=self.compose_file.parent)

    def engine(self, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
        return run([self.runtime.engine, *args], timeout, check=check)

    def up(self, services: list[str], scale: dict[str, int]) -> None:
        """All services up; podman-compose takes one --scale per call (it keeps
        the last), so there each further scaled service gets an `up` of its own,
        which adds replicas and leaves the running containers alone."""
        scales = [("--scale", f"{name}={count}") for name, count in scale.items()]
        if self.runtime.engine == "podman":
            self.compose("up", "-d", "--no-build", *scales[0], *services, timeout=900)
            for (name, _), arg in zip(list(scale.items())[1:], scales[1:]):
                self.compose("up", "-d", "--no-build", *arg, name, timeout=900)
        else:
            self.compose("up", "-d", "--no-build", *[a for pair in scales for a in pair], *services, timeout=900)

    def down(self) -> None:
        """compose down (twice: podman-compose can leave a scaled replica the
        first time), then anything still labelled with the project removed."""
        for _ in range(2):
            self.compose("down", "--remove-orphans", "-t", "5", timeout=300, check=False)
        for container in self.containers():
            self.engine("rm", "-f", container, check=False)
        if self.runtime.engine == "podman":
            self.engine("network", "rm", "-f", f"{self.project}_default", check=False)

    def containers(self, service: str | None = None, running_only: bool = False) -> list[str]:
        filters = ["--filter", f"label=com.docker.compose.project={self.project}"]
        if service:
            filters += ["--filter", f"label=com.docker.compose.service={service}"]
        if running_only:
            filters += ["--filter", "status=running"]
        output = self.engine("ps", "-a", "-q", "--no-trunc", *filters).stdout
        return sorted(output.split())

    def hostname(self, container: str) -> str:
        return self.engine("inspect", "-f", "{{.Config.Hostname}}", container).stdout.strip()

    def kill(self, container: str) -> None:
        self.engine("kill", "-s", "KILL", container)

    def logs(self, tail: int = 60) -> str:
        """The last lines of every container's log, for a failure's report."""
        parts = []
        for container in self.containers():
            name = self.engine("inspect", "-f", "{{.Name}}", container, check=False).stdout.strip()
            logs = self.engine("logs", "--tail", str(tail), container, check=False)
            parts.append(f"--- {name}\n{logs.stdout}{logs.stderr}")
        return "\n".join(parts)


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 2.0):
    """Polls predicate until it returns something truthy; its last exception or
    value goes into the failure."""
    deadline = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
            last = value
        except (httpx.HTTPError, ValueError, KeyError, AssertionError) as error:   # a 503 while starting
            last = error
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}; last: {last!r}")
