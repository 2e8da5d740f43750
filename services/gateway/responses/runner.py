"""Fills a response from its generation: the deltas of the scheduler's stream
(tool calls read out of them) become the response's events in the store; the
end, an error or a cancel closes it. Runs as a task of its own, so a
background response goes on without its client."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing

from services.gateway.requests.backend import BackendError
from services.gateway.errors import from_backend
from services.gateway.streaming.generation import TextDelta
from services.gateway.responses.store import ResponseRecord, ResponseStore

log = logging.getLogger(__name__)
Deltas = AsyncIterator[tuple[int, TextDelta]]


async def fill(record: ResponseRecord, store: ResponseStore, deltas: Deltas) -> None:
    """Runs the generation into `record` until it ends, fails or is cancelled."""
    builder = record.builder
    record.add(builder.start())
    try:
        async with aclosing(deltas):  # type: ignore[type-var]
            async for _, delta in deltas:
                record.add(builder.delta(delta))
                if delta.finish_reason is not None:
                    record.add(builder.finish(delta.finish_reason, delta.usage))
    except asyncio.CancelledError:
        builder.cancel()
        store.ended(record)
        raise
    except BackendError as error:
        if not builder.output:
            record.failure = error
        api_error = from_backend(error)
        record.add(builder.fail(str(api_error.code or api_error.type), api_error.message))
    except Exception as error:   # noqa: BLE001 - the response says it failed; the log says why
        log.exception("response generation failed", extra={"response_id": record.response_id})
        record.add(builder.fail("server_error", f"The response failed: {type(error).__name__}"))
    else:
        if builder.status == "in_progress":   # no finish came: the stream ended early
            record.add(builder.fail("server_error", "The generation ended without a finish."))
    store.ended(record)


def start(record: ResponseRecord, store: ResponseStore, deltas: Deltas,
          tasks: set[asyncio.Task[None]]) -> None:
    """Starts filling `record` as a task kept in `tasks` until it ends."""
    task = asyncio.create_task(fill(record, store, deltas))
    record.task = task
    tasks.add(task)
    task.add_done_callback(tasks.discard)

