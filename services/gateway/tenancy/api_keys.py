"""The API key a request presents, read from raw header bytes (HTTP) or
metadata (gRPC): `Authorization: Bearer <key>`, else `x-api-key: <key>`.

A key is printable ASCII without spaces; anything else (bytes >= 0x80,
control characters, an empty value) presents no key, so the request gets
401, never an error while parsing. Pure: no web or gRPC imports.
"""

from __future__ import annotations

from collections.abc import Iterable

AUTHORIZATION = b"authorization"
X_API_KEY = b"x-api-key"
BEARER = b"bearer"


def _valid(raw: bytes) -> bytes | None:
    return raw if raw and all(0x21 <= byte <= 0x7E for byte in raw) else None


def presented_key(headers: Iterable[tuple[bytes, bytes]]) -> bytes | None:
    """The key in the first Authorization header with the Bearer scheme, else
    in the first x-api-key header; None when there is none or it is malformed."""
    authorization: bytes | None = None
    api_key: bytes | None = None
    for name, value in headers:
        lowered = name.lower()
        if lowered == AUTHORIZATION and authorization is None:
            authorization = value
        elif lowered == X_API_KEY and api_key is None:
            api_key = value
    if authorization is not None:
        scheme, _, value = authorization.strip().partition(b" ")
        if scheme.lower() == BEARER:
            return _valid(value.strip())
    return _valid(api_key.strip()) if api_key is not None else None


def metadata_key(metadata: Iterable[tuple[str, str | bytes]] | None) -> bytes | None:
    """presented_key over gRPC metadata (text values arrive as str)."""
    def raw(value: str | bytes) -> bytes:
        return value if isinstance(value, bytes) else value.encode("utf-8", errors="replace")

    return presented_key((raw(key), raw(value)) for key, value in metadata or ())
