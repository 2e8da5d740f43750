"""`make run`: starts the stack on the default ports, with its internal ports
closed by tokens of its own (local_tokens.py) unless the user gives them,
prints the URL, starts again a service that exits (supervisor.py), and stops
every process on Ctrl-C or SIGTERM."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Mapping
from pathlib import Path

from common.observability.metrics import serve_metrics
from common.model_store import default_cache_dir, default_model_dir, is_prepared, resolve_model_dir
from common.transport.internal_auth import read_token
from common.settings.env import EnvReader, SettingsError
from fairserve.launcher.local_tokens import local_tokens, tokens_path
from fairserve.launcher.settings_schema import RunSchema
from fairserve.launcher.stack import ROOT, Stack, StackPorts
from fairserve.launcher.stub_sources import stale_stubs
from services.worker.settings_schema import WorkerSchema
from fairserve.launcher.supervisor import Supervisor, SupervisorMetrics, SupervisorSettings


def ports_from_env(env: Mapping[str, str]) -> StackPorts:
    """The default ports, or those named in the environment."""
    defaults = StackPorts()
    port = lambda name, default: int(env.get(name) or default)  # noqa: E731
    return StackPorts(
        gateway=port("GATEWAY_PORT", defaults.gateway),
        gateway_grpc=port("GATEWAY_GRPC_PORT", defaults.gateway_grpc),
        scheduler=port("SCHEDULER_PORT", defaults.scheduler),
        scheduler_metrics=port("SCHEDULER_METRICS_PORT", defaults.scheduler_metrics),
        kvcache=port("KVCACHE_PORT", defaults.kvcache),
        kvcache_metrics=port("KVCACHE_METRICS_PORT", defaults.kvcache_metrics),
        workers=[(port("WORKER_PORT", defaults.workers[0][0]),
                  port("WORKER_METRICS_PORT", defaults.workers[0][1]))],
    )


def main() -> int:
    stale = stale_stubs(ROOT)
    if stale is not None:
        print(stale, file=sys.stderr)
        return 2
    try:
        log_dir = Path(RunSchema.read(os.environ).log_dir or "~/.cache/fairserve/logs").expanduser()
        supervision = SupervisorSettings.from_env(os.environ)
        # INTERNAL_TOKEN, WORKER_TOKEN and GRPC_TLS_* reach the services through the
        # environment; the user's are checked first, so that a bad one stops the start
        # with its own message, then those left unset are generated (local_tokens.py).
        user = Stack(ports=ports_from_env(os.environ), env={}, log_dir=log_dir)
        user.internal_auth()
        read_token(EnvReader(user.service_env()), "WORKER_TOKEN", "WORKER_TOKEN_FILE")
        tokens_file = tokens_path(os.environ)
        stack = Stack(ports=user.ports, env=local_tokens(os.environ, tokens_file), log_dir=log_dir)
        auth = stack.internal_auth()
        stack.worker_token()
    except SettingsError as error:
        print(f"invalid setting: {error}", file=sys.stderr)
        return 2
    except OSError as error:
        print(f"cannot keep the generated tokens: {error}", file=sys.stderr)
        return 2
    # Ctrl-C and SIGTERM both stop every service; SIGINT is set explicitly because a
    # process started in the background inherits it ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    metrics = SupervisorMetrics()
    try:
        metrics_port = serve_metrics(supervision.metrics_port, metrics.registry,
                                     host=supervision.metrics_host)
    except OSError as error:
        print(f"SUPERVISOR_METRICS_PORT={supervision.metrics_port} cannot be served: {error}",
              file=sys.stderr)
        return 2
    generated = f", generated tokens in {tokens_file}" if stack.env else ""
    print("starting kvcache, scheduler, worker and gateway (logs in "
          f"{stack.log_dir}; internal calls: {auth!r}{generated}) ...", flush=True)
    try:
        prepare_model(os.environ)
        stack.start(timeout_s=600)
        print_banner(stack, metrics_port)
        Supervisor(stack, metrics).run()   # until Ctrl-C or SIGTERM
    except KeyboardInterrupt:
        print("\nstopping ...", flush=True)
        return 0
    finally:
        stack.stop()


def prepare_model(env: Mapping[str, str]) -> None:
    """The model the services load, converted once into the cache before they start (the
    default model: about a minute and a half the first time, then nothing)."""
    values = WorkerSchema.read(env)
    cache = Path(values.model_cache_dir or default_cache_dir()).expanduser()
    if not values.model_name and not is_prepared(default_model_dir(cache)):
        print(f"preparing the default model in {cache} (once) ...", flush=True)
    resolve_model_dir(values.model_name, cache)


def print_banner(stack: Stack, metrics_port: int) -> None:
    print(f"\nfairserve is ready at {stack.url}  (dashboard: {stack.url}/dashboard)\n")
    print("try:\n  curl -N " + stack.url + "/generate -d '{\"prompt\":\"The capital of France is\","
          "\"max_tokens\":20,\"raw\":true}'\n\n"
          "A service that exits is started again (restarts: "
          f"http://127.0.0.1:{metrics_port}/metrics). Ctrl-C stops every service.", flush=True)


if __name__ == "__main__":
    sys.exit(main())
