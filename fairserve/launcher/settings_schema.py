"""The launcher's own settings (`fairserve run`, `make run`); each service's are its own schema's.

One field per environment variable, as in every service (common/settings/schema.py).
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from common.settings.schema import SettingsSchema


class RunSchema(SettingsSchema):
    service: ClassVar[str] = "run"

    supervisor_metrics_port: int = Field(9104, ge=0, le=65535, description=(
        "the launcher's Prometheus `/metrics`: restarts of each service it started again after an "
        "exit, and when each one's process started (0 picks a free port)"))
    log_dir: str = Field("", description=(
        "where each service's log file goes (`<service>.log`); empty: `~/.cache/fairserve/logs`"))
    local_tokens_file: str = Field("", description=(
        "where the launcher keeps the `INTERNAL_TOKEN` and `WORKER_TOKEN` it generates when none is "
        "given (made once, 0600 in a 0700 folder, reused); empty: "
        "`~/.cache/fairserve/tokens/local.json`"))
