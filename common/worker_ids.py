"""What a worker id may be, for the worker that makes its own (services/worker/settings.py)
and the scheduler that checks it at registration (services/scheduler/workers/registration.py):
letters, digits, '.', '_' and '-', starting with a letter or digit, at most 128 characters."""

from __future__ import annotations

import re

MAX_WORKER_ID_LENGTH = 128
WORKER_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
