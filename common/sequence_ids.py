"""Sequence ids that name the request they serve.

The scheduler gives each incarnation of a request on a worker (a new one
after every preemption) its own sequence id, made of the request id and a
unique suffix. Workers only see sequence ids, so a worker's log line about a
sequence can name the request, and one grep of a request id follows it
through every service.
"""

from __future__ import annotations

SEPARATOR = "/"


def sequence_id(request_id: str, unique_suffix: str) -> str:
    if SEPARATOR in unique_suffix:
        raise ValueError(f"the suffix may not contain {SEPARATOR!r}: {unique_suffix!r}")
    return f"{request_id}{SEPARATOR}{unique_suffix}"


def request_id_of(seq_id: str) -> str:
    """The request id part of a sequence id; a sequence id made elsewhere
    (no separator) is its own request id."""
    request_id, separator, _suffix = seq_id.rpartition(SEPARATOR)
    return request_id if separator else seq_id
