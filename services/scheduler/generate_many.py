"""GenerateMany, the scheduler's side: a gateway's requests over one call (stream_mux.py
has the book-keeping and a picture). Each submit is admitted as a Generate call's request
is (the service's `admit`), its updates go to the call's connection, and one writer sends
every update waiting as one message; a stream that finishes, is refused or is cancelled
ends as its Generate call would (the service's `end_stream`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator
from contextlib import contextmanager

import grpc
from fairserve.v1 import scheduler_pb2

from common.observability.logs import request_id_var
from services.scheduler import convert
from services.scheduler.core.types import Gate, Rejection, RequestUpdate, SubmitResult
from services.scheduler.stream_mux import StreamConnection, StreamInUse

log = logging.getLogger(__name__)

MAX_STREAM_MESSAGE_BYTES = 1 << 20     # a message's events, about

Admit = Callable[[scheduler_pb2.GenerateRequest, str, str, Callable[[RequestUpdate], None]], Awaitable[SubmitResult]]
EndStream = Callable[[str, bool, str, bool], None]


class GenerateMany:
    def __init__(self, admit: Admit, end_stream: EndStream,
                 log_finish: Callable[[str, RequestUpdate], None]) -> None:
        self._admit = admit
        self._end_stream = end_stream
        self._log_finish = log_finish

    async def serve(self, request_iterator: AsyncIterator[scheduler_pb2.StreamRequest],
                    context: grpc.aio.ServicerContext) -> AsyncIterator[scheduler_pb2.StreamEvents]:
        """Many requests over one call (stream_mux.py): one message carries every event
        ready when the writer wakes, at most MAX_STREAM_MESSAGE_BYTES of them."""
        connection = StreamConnection()
        admissions: set[asyncio.Task[None]] = set()
        reader = asyncio.create_task(self._read(request_iterator, connection, admissions))
        try:
            while True:
                failure = reader.exception() if reader.done() and not reader.cancelled() else None
                if isinstance(failure, StreamInUse):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(failure))
                elif failure is not None:
                    raise failure
                if not connection.pending:
                    if reader.done() and not connection.open and not connection.admitting:
                        return      # the caller sends no more and every request has ended
                    waiting = asyncio.ensure_future(connection.ready.wait())
                    await asyncio.wait((waiting, reader) if not reader.done() else (waiting,),
                                       return_when=asyncio.FIRST_COMPLETED)
                    waiting.cancel()
                for message in self._messages(connection):
                    yield message
        finally:
            reader.cancel()
            for task in list(admissions):
                task.cancel()
            for stream in list(connection.open.values()):
                with _logging_as(stream.trace_id):
                    self._end_stream(stream.request_id, False, "cancelled", stream.detached)
            connection.open.clear()

    async def _read(self, request_iterator: AsyncIterator[scheduler_pb2.StreamRequest],
                    connection: StreamConnection, admissions: set[asyncio.Task[None]]) -> None:
        async for message in request_iterator:
            for submit in message.submit:
                if connection.in_use(submit.stream):
                    raise StreamInUse(f"stream {submit.stream} is in use on this call")
                connection.begin(submit.stream)
                task = asyncio.create_task(self._admit_one(submit, connection))
                admissions.add(task)
                task.add_done_callback(admissions.discard)
            for stream in message.cancel:
                ended = connection.cancel(stream)
                if ended is not None:
                    with _logging_as(ended.trace_id):
                        self._end_stream(ended.request_id, False, "cancelled", ended.detached)
        # The caller sends nothing more; its open requests still get their events.
        while admissions:
            await asyncio.wait(set(admissions))

    async def _admit_one(self, submit: scheduler_pb2.StreamSubmit, connection: StreamConnection) -> None:
        request = submit.request
        if submit.trace_id:
            request_id_var.set(submit.trace_id)
        try:
            result = await self._admit(request, submit.trace_id, submit.traceparent,
                                       lambda update: connection.put(submit.stream, update))
        except Exception:
            log.exception("admitting a request failed")
            connection.refused(submit.stream)
            connection.put(submit.stream, RequestUpdate(request.request_id, rejection=Rejection(
                Gate.INVALID, "the scheduler could not admit the request")))
            return
        if result.rejection is not None:
            connection.refused(submit.stream)
            connection.put(submit.stream, RequestUpdate(result.request_id, rejection=result.rejection))
        elif not connection.opened(submit.stream, result.request_id, request.detached, submit.trace_id,
                                   request.packed_tokens):
            connection.close(submit.stream)
            self._end_stream(result.request_id, False, "cancelled", request.detached)

    def _messages(self, connection: StreamConnection) -> Iterable[scheduler_pb2.StreamEvents]:
        """The waiting events as messages of about MAX_STREAM_MESSAGE_BYTES at most; a
        refused or finished stream is ended as its event is taken (as Generate ends its call)."""
        message, size = scheduler_pb2.StreamEvents(), 0
        for stream, update in connection.take():
            current = connection.open.get(stream)
            if update.rejection is None and (current is None or current.request_id != update.request_id):
                continue        # its caller cancelled it
            size += convert.add_stream_event(message, stream, update, current is not None and current.packed)
            if current is not None and (update.rejection is not None or update.finish is not None):
                connection.close(stream)
                with _logging_as(current.trace_id):
                    if update.finish is not None:
                        self._log_finish(update.request_id, update)
                    reason = update.finish.reason.value if update.finish is not None else "rejected"
                    self._end_stream(update.request_id, True, reason, current.detached)
            if size >= MAX_STREAM_MESSAGE_BYTES:
                yield message
                message, size = scheduler_pb2.StreamEvents(), 0
        if message.events:
            yield message


@contextmanager
def _logging_as(trace_id: str) -> Iterator[None]:
    """Logs within carry a GenerateMany stream's request id (and so its trace id), as a
    Generate call's handler's logs do."""
    token = request_id_var.set(trace_id or None)
    try:
        yield
    finally:
        request_id_var.reset(token)
