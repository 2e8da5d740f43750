"""What a client may name its request, at every door (HTTP's X-Request-ID
header, the gRPC API's x-request-id metadata): 1 to 128 characters of
letters, digits and `._:-`. Any other value is ignored and replaced with a
fresh id (never refused, never logged), so a request id in the logs is
always short and plain."""

from __future__ import annotations

import re

MAX_REQUEST_ID_CHARS = 128
_VALID_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,%d}" % MAX_REQUEST_ID_CHARS)


def client_request_id(value: str | bytes | None) -> str | None:
    """`value` when it is a valid request id; None otherwise (make a new one)."""
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    if value is None or len(value) > MAX_REQUEST_ID_CHARS:
        return None
    return value if _VALID_REQUEST_ID.fullmatch(value) else None
