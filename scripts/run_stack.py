"""`make run`: starts the stack on the default ports, prints the URL, and
stops every process on Ctrl-C."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from common.settings import SettingsError
from scripts.stack import ROOT, Stack, StackPorts


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
    stack = Stack(ports=ports_from_env(os.environ), env={},
                  log_dir=Path(os.environ.get("LOG_DIR") or ROOT / ".cache" / "logs"))
    try:
        # INTERNAL_TOKEN and GRPC_TLS_* reach every service through the environment;
        # checked here first so that a bad one stops the start with its own message.
        auth = stack.internal_auth()
    except SettingsError as error:
        print(f"invalid setting: {error}", file=sys.stderr)
        return 2
    # Ctrl-C and SIGTERM both stop every service; SIGINT is set explicitly because a
    # process started in the background inherits it ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    print("starting kvcache, scheduler, worker and gateway (logs in "
          f"{stack.log_dir}; internal calls: {auth!r}) ...", flush=True)
    try:
        stack.start(timeout_s=600)
        print(f"\nfairserve is ready at {stack.url}  (dashboard: {stack.url}/dashboard)\n")
        print("try:\n  curl -N " + stack.url + "/generate -d '{\"prompt\":\"The capital of France is\","
              "\"max_tokens\":20,\"raw\":true}'\n\nCtrl-C stops every service.", flush=True)
        while all(p.poll() is None for p in stack.processes.values()):
            time.sleep(0.5)
        dead = [name for name, p in stack.processes.items() if p.poll() is not None]
        print(f"{', '.join(dead)} exited; stopping the rest. Last log lines:\n{stack.tail(dead[0])}",
              file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nstopping ...", flush=True)
        return 0
    finally:
        stack.stop()


if __name__ == "__main__":
    sys.exit(main())
