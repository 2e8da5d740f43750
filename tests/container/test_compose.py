"""deploy/compose.yaml in containers, as a user runs it: `make image`, then the
stack up with two workers and two gateways behind the proxy. Both workers
register under their containers' hostnames and both take requests; Prometheus
scrapes every replica and every expression of the Grafana dashboard returns
series under load; a worker killed loses no later request. The stack is torn
down at the end, also when something fails. Skipped where no container runtime
answers (CI prepares podman where the shared runtime tool exists)."""

from __future__ import annotations

import itertools
import os
import secrets
import shutil
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from fairserve.launcher.stack import free_ports
from tests.container.compose_stack import ROOT, ComposeStack, find_runtime, make_image_command, run, wait_for
from tests.container.prometheus import dashboard_expressions, query, target_counts, up_by_job

RUNTIME, NO_RUNTIME = find_runtime()
if RUNTIME is None:
    pytest.skip(NO_RUNTIME, allow_module_level=True)
pytestmark = [pytest.mark.container, pytest.mark.timeout(2400)]

SERVICES = ["redis", "kvcache", "scheduler", "worker", "gateway", "proxy", "prometheus"]
SCALE = {"worker": 2, "gateway": 2}
SCRAPED = {"gateway": 2, "scheduler": 1, "worker": 2, "kvcache": 1}
# Dashboard expressions with nothing to show in this stack, and why; every
# other one must return series.
NOTHING_HERE = {
    "fairserve_supervisor_restarts_total": "make run's launcher; under compose the runtime restarts services",
    "time() - fairserve_supervisor_start_time_seconds": "make run's launcher, as above",
}


@pytest.fixture(scope="module")
def stack(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ComposeStack]:
    run(make_image_command(RUNTIME), timeout=1500, cwd=ROOT)
    # The committed compose file and monitoring configuration, in the same
    # layout, next to secrets of the test's own (deploy/secrets/ is the user's).
    workdir = tmp_path_factory.mktemp("compose")
    (workdir / "deploy" / "secrets").mkdir(parents=True)
    shutil.copy(ROOT / "deploy" / "compose.yaml", workdir / "deploy" / "compose.yaml")
    shutil.copytree(ROOT / "monitoring", workdir / "monitoring")
    for name in ("internal_token", "worker_token"):    # the workers' token is not the services'
        token = workdir / "deploy" / "secrets" / name
        token.write_text(secrets.token_hex(32))
        token.chmod(0o644)                     # bind-mounted as it is; the services run as uid 10001
    redis_password = workdir / "deploy" / "secrets" / "redis_password"
    redis_password.write_text(secrets.token_hex(32))
    redis_password.chmod(0o644)                # read by Redis (uid 999) and the kvcache (uid 10001)
    (workdir / "deploy" / "secrets" / "gateway.env").write_text("")      # no API keys: an open API
    http_port, grpc_port, prometheus_port = free_ports(3)
    env = {**os.environ, "FAIRSERVE_PORT": str(http_port), "FAIRSERVE_GRPC_PORT": str(grpc_port),
           "PROMETHEUS_PORT": str(prometheus_port)}
    compose = ComposeStack(RUNTIME, "fairserve-ct", workdir / "deploy" / "compose.yaml", env,
                           url=f"http://127.0.0.1:{http_port}", prometheus=f"http://127.0.0.1:{prometheus_port}")
    compose.down()                             # what an interrupted run left
    failed_before = request.session.testsfailed
    try:
        compose.up(SERVICES, SCALE)
        wait_for(lambda: len(healthy_workers(compose)) == 2, 900, "two healthy workers in /stats")
        yield compose
    except BaseException:
        _report(request, compose.logs())
        raise
    else:
        if request.session.testsfailed > failed_before:
            _report(request, compose.logs())
    finally:
        compose.down()
        assert compose.containers() == [], "containers left after compose down"


def _report(request: pytest.FixtureRequest, text: str) -> None:
    """The containers' logs straight to the terminal (a module fixture's
    output is not shown with a test's failure)."""
    with request.config.pluginmanager.getplugin("capturemanager").global_and_fixture_disabled():
        print(f"\n{text}", flush=True)


def stats(stack: ComposeStack) -> dict:
    reply = httpx.get(f"{stack.url}/stats", timeout=10)
    reply.raise_for_status()
    return reply.json()


def registered_workers(stack: ComposeStack) -> list[dict]:
    scheduler = stats(stack)["scheduler"]          # None while the gateway cannot reach it
    return scheduler["workers"] if scheduler else []


def healthy_workers(stack: ComposeStack) -> list[dict]:
    return [worker for worker in registered_workers(stack) if worker["healthy"]]


def wait_healthy(stack: ComposeStack, count: int) -> list[dict]:
    """A worker starved of CPU can miss a heartbeat and be unhealthy for a moment."""
    def healthy() -> list[dict] | None:
        workers = healthy_workers(stack)
        return workers if len(workers) == count else None

    return wait_for(healthy, 120, f"{count} healthy workers in /stats")


def generate(stack: ComposeStack, prompt: str, max_tokens: int = 12) -> dict:
    """One non-streaming /generate through the proxy; anything but a complete
    JSON answer fails (also a transport error: the pollers retry only those of /stats)."""
    try:
        reply = httpx.post(f"{stack.url}/generate", timeout=180,
                           json={"prompt": prompt, "max_tokens": max_tokens, "stream": False})
    except httpx.HTTPError as error:
        raise AssertionError(f"/generate failed: {error!r}") from error
    assert reply.status_code == 200, (prompt, reply.status_code, reply.text)
    assert reply.headers["content-type"].startswith("application/json"), reply.text[:200]
    body = reply.json()
    assert body["finish_reason"] in ("length", "stop") and body["usage"]["completion_tokens"] > 0, body
    return body


def generate_many(stack: ComposeStack, prompts: list[str], concurrency: int = 8) -> list[dict]:
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda prompt: generate(stack, prompt), prompts))


def test_two_workers_register_under_their_container_hostnames(stack: ComposeStack) -> None:
    containers = stack.containers("worker", running_only=True)
    assert len(containers) == 2
    hostnames = sorted(stack.hostname(container) for container in containers)
    ids = sorted(worker["worker_id"] for worker in registered_workers(stack))
    assert len(set(ids)) == len(ids) == 2, ids
    assert sorted(worker["worker_id"] for worker in wait_healthy(stack, 2)) == ids
    # worker-<hostname>-<pid>: each replica named after its own container
    assert sorted(i.removeprefix("worker-").rsplit("-", 1)[0] for i in ids) == hostnames, (ids, hostnames)


def test_both_workers_take_requests(stack: ComposeStack) -> None:
    before = {w["worker_id"]: w["steps"] for w in registered_workers(stack)}
    assert len(before) == 2, before

    rounds = itertools.count()

    def both_stepped() -> bool:
        # new prompts each round: a prompt seen before goes back to the worker that cached it
        round_ = next(rounds)
        generate_many(stack, [f"{round_ * 16 + n} is a number; tell a short story about it." for n in range(16)])
        after = {w["worker_id"]: w["steps"] for w in registered_workers(stack)}
        return all(after.get(worker, 0) > steps for worker, steps in before.items())

    wait_for(both_stepped, 600, "both workers to run steps for requests through the proxy", interval_s=0)


def test_prometheus_scrapes_every_replica(stack: ComposeStack) -> None:
    def all_up() -> dict[str, list[str]] | None:
        up = up_by_job(stack.prometheus, tuple(SCRAPED))
        counts = {job: len(instances) for job, instances in up.items()}
        return up if counts == SCRAPED and target_counts(stack.prometheus, tuple(SCRAPED)) == SCRAPED else None

    up = wait_for(all_up, 180, f"up == 1 for {SCRAPED} targets")
    for job in ("gateway", "worker"):           # one target per replica, each at its own address
        assert len({instance.rsplit(":", 1)[0] for instance in up[job]}) == SCRAPED[job], up[job]


def test_every_dashboard_expression_returns_series_under_load(stack: ComposeStack) -> None:
    stop = threading.Event()

    def load(user: int) -> None:
        n = 0
        while not stop.is_set():
            generate(stack, f"User {user} asks question {n}: what comes after {n}?", max_tokens=8)
            n += 1

    expressions = dashboard_expressions()
    assert set(NOTHING_HERE) <= set(expressions)
    with ThreadPoolExecutor(4) as pool:
        users = [pool.submit(load, user) for user in range(4)]
        try:
            def every_expression_has_series() -> bool:
                # every query must succeed; a rate needs two scrapes under load, so retry
                empty = {expr for expr in expressions if not query(stack.prometheus, expr)}
                if empty - set(NOTHING_HERE):
                    raise ValueError(f"no series from {sorted(empty - set(NOTHING_HERE))}")
                return True

            wait_for(every_expression_has_series, 180, "series from every dashboard expression", interval_s=5)
        finally:
            stop.set()
        for user in users:
            user.result()                      # a failed request under load fails the test


def test_a_killed_worker_loses_no_later_request(stack: ComposeStack) -> None:
    victim, survivor = stack.containers("worker", running_only=True)
    stack.kill(victim)
    results = generate_many(stack, [f"After the kill, request {n}: name a colour." for n in range(24)],
                            concurrency=4)
    assert len(results) == 24
    # and the scheduler still has a worker, the survivor, serving
    wait_for(lambda: any(w["worker_id"].startswith(f"worker-{stack.hostname(survivor)}-")
                         for w in healthy_workers(stack)), 120, "the surviving worker healthy in /stats")
    assert query(stack.prometheus, 'up{job="scheduler"} == 1')
